"""Finish conditions: stop strings across token boundaries, stop ids, EOS, max_tokens."""

from __future__ import annotations

from mooncaked.model.sampling_params import SamplingParams
from mooncaked.model.stopping import FINISH_LENGTH, FINISH_STOP, GenerationState, StopStringMatcher
from mooncaked.model.tokenizer import byte_level_test_tokenizer

EOS = 2


def _run(params: SamplingParams, text: str) -> tuple[list[str], GenerationState]:
    tok = byte_level_test_tokenizer()
    state = GenerationState(tok, params, eos_token_ids=(EOS,))
    deltas = []
    for token_id in tok.encode(text, add_special_tokens=False):
        step = state.append(token_id)
        deltas.append(step.text)
        if step.finish_reason is not None:
            break
    return deltas, state


def test_stop_string_spanning_tokens_truncates_and_holds_back() -> None:
    deltas, state = _run(SamplingParams(max_tokens=100, stop=["STOP"]), "abc STOP and more")
    assert state.finish_reason == FINISH_STOP
    assert "".join(deltas) == "abc " and state.text == "abc "
    assert deltas[4:7] == ["", "", ""]  # "S", "T", "O" could still start "STOP": held back


def test_held_text_is_released_when_it_stops_matching() -> None:
    deltas, state = _run(SamplingParams(max_tokens=100, stop=["STOP"]), "ST then")
    assert state.finish_reason is None
    assert "".join(deltas) == "ST then"
    assert deltas[:3] == ["", "", "ST "]


def test_include_stop_string_and_earliest_match() -> None:
    _, state = _run(SamplingParams(max_tokens=100, stop=["yz", "xy"], include_stop_str_in_output=True), "wxyz")
    assert state.text == "wxy"


def test_eos_stop_ids_and_ignore_eos() -> None:
    tok = byte_level_test_tokenizer()
    state = GenerationState(tok, SamplingParams(max_tokens=10), eos_token_ids=(EOS,))
    assert state.append(tok.encode("a")[0]).text == "a"
    assert state.append(EOS).finish_reason == FINISH_STOP
    ignoring = GenerationState(tok, SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(7,)),
                               eos_token_ids=(EOS,))
    assert ignoring.append(EOS).finish_reason is None
    assert ignoring.append(7).finish_reason == FINISH_STOP


def test_max_tokens_flushes_held_text() -> None:
    deltas, state = _run(SamplingParams(max_tokens=3, stop=["abcd"]), "abcdef")
    assert state.finish_reason == FINISH_LENGTH
    assert "".join(deltas) == "abc" and len(state.output_ids) == 3


def test_matcher_finds_stop_split_across_many_feeds() -> None:
    matcher = StopStringMatcher(["<end>"])
    released = "".join(matcher.feed(piece) for piece in ["x<", "e", "n", "d>tail"])
    assert released == "x" and matcher.matched == "<end>"
    assert matcher.feed("more") == ""


def test_before_min_tokens_neither_stop_strings_nor_stop_ids_end_it() -> None:
    """vLLM's rule: a stop string must end at or after the min_tokens-th token; one wholly before is output."""
    deltas, state = _run(SamplingParams(max_tokens=100, stop=["ab"], min_tokens=4), "ab ab ab")
    assert state.finish_reason == FINISH_STOP and state.text == "ab "
    tok = byte_level_test_tokenizer()
    held = GenerationState(tok, SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=(7,)),
                           eos_token_ids=(EOS,))
    assert held.append(EOS).finish_reason is None
    assert held.append(7).finish_reason == FINISH_STOP


def test_a_stop_string_completed_by_the_min_tokens_th_token_matches() -> None:
    _, state = _run(SamplingParams(max_tokens=100, stop=["abc"], min_tokens=3), "abcdef")
    assert state.finish_reason == FINISH_STOP and state.text == "" and len(state.output_ids) == 3


def test_special_tokens_stay_in_the_text_when_not_skipped() -> None:
    tok = byte_level_test_tokenizer()
    kept = GenerationState(tok, SamplingParams(max_tokens=2, ignore_eos=True, skip_special_tokens=False))
    skipped = GenerationState(tok, SamplingParams(max_tokens=2, ignore_eos=True))
    for state in (kept, skipped):
        state.append(EOS)
        state.append(tok.encode("d", add_special_tokens=False)[0])
    assert kept.text == "<|im_end|>d" and skipped.text == "d"
