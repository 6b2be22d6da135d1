"""Every supported family, from a tiny random checkpoint written by transformers, through the engine's paged
runner: logits equal transformers' (fp32), greedy generations equal `generate`, chat templates render alike."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncaked.engine.batch import DecodeSeq, PrefillSeq, build_decode_batch, build_prefill_batch
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.page_allocator import PageAllocator
from mooncaked.engine.runner import ModelRunner
from mooncaked.model.chat_template import ChatTemplateError
from mooncaked.model.frontend import load_frontend
from mooncaked.model.loader import LoadedModel, load_model
from tests.model.family_checkpoints import CASE_IDS, CASES, FamilyCase, hf_config, write_checkpoint

transformers = pytest.importorskip("transformers")

BLOCK = 8  # small pages: prompts cross several, and the sliding windows (8) cross page boundaries
NUM_PAGES = 24
PROMPTS = [[3 + (7 * i) % 250 for i in range(21)], [3 + (11 * i + 5) % 250 for i in range(13)]]
NEW_TOKENS = 12


@dataclass(frozen=True)
class Family:
    case: FamilyCase
    path: Path
    hf: Any
    loaded: LoadedModel


@pytest.fixture(scope="module", params=CASES, ids=CASE_IDS)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    case: FamilyCase = request.param
    path = tmp_path_factory.mktemp(case.case_id)
    hf = write_checkpoint(case, path, seed=11)
    return Family(case, path, hf, load_model(str(path)))


def _runner(loaded: LoadedModel, backend: str = "torch") -> ModelRunner:
    kv = KVPages.for_model(loaded.args, num_pages=NUM_PAGES, block_size=BLOCK, dtype=torch.float32, device="cpu")
    return ModelRunner(loaded.model, kv, backend=backend)


def _prefill(runner: ModelRunner, seqs: list[PrefillSeq]) -> torch.Tensor:
    batch = build_prefill_batch(seqs, block_size=BLOCK, num_pages=NUM_PAGES, device="cpu")
    return runner.prefill(batch, return_all_logits=True)


def _decode(runner: ModelRunner, seqs: list[DecodeSeq]) -> torch.Tensor:
    return runner.decode(build_decode_batch(seqs, block_size=BLOCK, num_pages=NUM_PAGES, device="cpu"))


def _paged_logits(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Prefill in two chunks (the second over the first's pages), then greedy decode: logits of every position."""
    pages = PageAllocator(runner.kv_pages.num_pages).allocate(runner.kv_pages.num_pages_for(len(prompt) + steps), "seq")
    split = len(prompt) - 8
    logits = [_prefill(runner, [PrefillSeq(prompt[:split], 0, pages)]),
              _prefill(runner, [PrefillSeq(prompt[split:], split, pages)])]
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(_decode(runner, [DecodeSeq(tokens[-1], len(tokens) - 1, pages)]))
    return torch.cat(logits), tokens


def test_loaded_family_and_options(family: Family) -> None:
    args, config = family.loaded.args, hf_config(family.case)
    assert args.family == family.case.model_type
    assert args.tie_word_embeddings == config.tie_word_embeddings
    if args.mla is not None:  # one cached latent "head" of the latent and the rope key, per token and layer
        assert (args.num_heads, args.num_kv_heads, args.head_dim, args.kv_head_dim, args.num_kv_planes) == (
            config.num_attention_heads, 1, config.qk_nope_head_dim + config.qk_rope_head_dim,
            config.kv_lora_rank + config.qk_rope_head_dim, 1)
        return
    assert (args.num_heads, args.num_kv_heads, args.head_dim) == (
        config.num_attention_heads, config.num_key_value_heads,
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    windows = [args.layer_sliding_window(i) for i in range(args.num_layers)]
    layer_types = getattr(config, "layer_types", None)
    if family.case.model_type == "mistral":
        assert windows == [config.sliding_window] * args.num_layers
    elif layer_types is not None:
        assert windows == [config.sliding_window if t == "sliding_attention" else None for t in layer_types]


@pytest.mark.parametrize("backend, is_packed", [("torch", True), ("torch", False), ("triton", True)],
                         ids=["torch-mkl-packed", "torch-plain-gemm", "triton-interpreter"])
def test_paged_logits_match_transformers(family: Family, backend: str, is_packed: bool) -> None:
    if backend == "triton" and family.case.case_id not in ("mistral-sliding-window", "qwen3-qk-norm-tied",
                                                           "deepseek-v3-mla-yarn-grouped-experts"):
        pytest.skip("the Triton interpreter is slow: three families cover its window, q/k-norm and latent paths")
    loaded = family.loaded if is_packed else load_model(str(family.path), cpu_packed_gemm=False)
    logits, tokens = _paged_logits(_runner(loaded, backend), PROMPTS[0], steps=8)
    with torch.no_grad():
        expected = family.hf(torch.tensor([tokens])).logits[0]
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_sliding_window_changes_the_result(family: Family) -> None:
    """The prompts are longer than the windows, so honouring the window is what makes the logits equal."""
    if family.loaded.args.sliding_window is None:
        pytest.skip("no sliding window in this family case")
    unwindowed = transformers.AutoModelForCausalLM.from_config(
        hf_config(family.case).__class__(**{**family.case.config, "sliding_window": None,
                                           "use_sliding_window": False})).eval()
    unwindowed.load_state_dict(family.hf.state_dict())
    with torch.no_grad():
        windowed_logits = family.hf(torch.tensor([PROMPTS[0]])).logits[0]
        full_logits = unwindowed(torch.tensor([PROMPTS[0]])).logits[0]
    assert float((windowed_logits - full_logits).abs().max()) > 1e-2


def test_greedy_batch_equals_transformers_generate(family: Family) -> None:
    runner = _runner(family.loaded)
    alloc = PageAllocator(runner.kv_pages.num_pages)
    eos = torch.tensor(family.loaded.eos_token_ids)
    pages = [alloc.allocate(runner.kv_pages.num_pages_for(len(p) + NEW_TOKENS), f"s{i}") for i, p in enumerate(PROMPTS)]
    logits = runner.prefill(build_prefill_batch([PrefillSeq(p, 0, pg) for p, pg in zip(PROMPTS, pages)],
                                                block_size=BLOCK, num_pages=NUM_PAGES, device="cpu"))
    outputs: list[list[int]] = [[] for _ in PROMPTS]
    for _ in range(NEW_TOKENS):
        # EOS suppressed as transformers' min_new_tokens does: every sequence runs NEW_TOKENS steps
        for out, token in zip(outputs, logits.index_fill(1, eos, float("-inf")).argmax(-1).tolist()):
            out.append(token)
        seqs = [DecodeSeq(out[-1], len(p) + len(out) - 1, pg) for p, out, pg in zip(PROMPTS, outputs, pages)]
        logits = _decode(runner, seqs)
    for prompt, ours in zip(PROMPTS, outputs):
        with torch.no_grad():
            generated = family.hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                           min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        assert ours == generated[0, len(prompt):].tolist()


def test_frontend_reads_the_same_checkpoint(family: Family) -> None:
    frontend = load_frontend(str(family.path))
    assert frontend.args == family.loaded.args and frontend.eos_token_ids == family.loaded.eos_token_ids
    assert frontend.chat_template.source == family.case.chat_template


_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)


@st.composite
def _conversations(draw: st.DrawFn) -> list[dict[str, str]]:
    """An optional system message, then user/assistant turns ending with a user turn; sometimes out of order."""
    messages = [{"role": "system", "content": draw(_TEXT)}] if draw(st.booleans()) else []
    num_turns = draw(st.integers(min_value=0, max_value=3))
    for _ in range(num_turns):
        messages += [{"role": "user", "content": draw(_TEXT)}, {"role": "assistant", "content": draw(_TEXT)}]
    messages.append({"role": "user", "content": draw(_TEXT)})
    if draw(st.integers(min_value=0, max_value=4)) == 0:  # break the alternation now and then
        index = draw(st.integers(min_value=0, max_value=len(messages) - 1))
        messages.insert(index, {"role": draw(st.sampled_from(["user", "assistant"])), "content": draw(_TEXT)})
    return messages


_TOOLS = st.none() | st.lists(st.fixed_dictionaries({"name": _TEXT, "description": _TEXT}), min_size=1, max_size=2)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=_conversations(), tools=_TOOLS, add_generation_prompt=st.booleans())
def test_chat_template_renders_like_transformers(family: Family, messages: list[dict[str, str]],
                                                 tools: list[dict[str, str]] | None,
                                                 add_generation_prompt: bool) -> None:
    hf_tokenizer = _hf_tokenizer(family.path)
    extra = family.case.extra_template_kwargs
    try:
        expected: str | None = hf_tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
    except Exception as exc:  # the template's raise_exception (roles out of order)
        assert "alternate" in str(exc)
        expected = None
    if expected is None:
        with pytest.raises(ChatTemplateError, match="alternate"):
            family.loaded.chat_template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                               **extra)
        return
    assert family.loaded.chat_template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                              **extra) == expected


_HF_TOKENIZERS: dict[Path, Any] = {}


def _hf_tokenizer(path: Path) -> Any:
    if path not in _HF_TOKENIZERS:
        _HF_TOKENIZERS[path] = transformers.AutoTokenizer.from_pretrained(str(path))
    return _HF_TOKENIZERS[path]
