"""The sampling options of a completion or chat request, read from its body (docs/api.md#sampling-controls).

`read_sampling(body, max_tokens)` checks every sampling field's type and range (the first bad one raises a 400
naming it) and returns the frozen `SamplingOptions` the conductor turns into the wire sampling spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mooncaked.api.errors import invalid_field
from mooncaked.api.fields import read_bool, read_float, read_int, read_int_list, read_logit_bias, read_stop

MAX_STOP_SEQUENCES = 16
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_SEED = 2**63 - 1  # a torch generator's seed
MAX_TOP_K = 1 << 20  # more than any vocabulary holds: a larger top_k would mean nothing more
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty: OpenAI's range [-2, 2]
MAX_REPETITION_PENALTY = 2.0  # repetition_penalty: (0, 2], 1 disables it


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int | None  # None: until the model's context is full
    temperature: float
    top_p: float
    top_k: int  # 0: disabled
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: disabled
    min_p: float = 0.0  # 0: disabled
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0
    include_stop_str_in_output: bool = False  # vLLM's: a matched stop string stays in the text
    skip_special_tokens: bool = True  # vLLM's: special tokens (EOS, template markers) are left out of the text


def read_sampling(body: Mapping[str, Any], max_tokens: int | None) -> SamplingOptions:
    top_k = read_int(body, "top_k", 0, lo=-1, hi=MAX_TOP_K)
    min_tokens = read_int(body, "min_tokens", 0, lo=0)
    assert min_tokens is not None
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid_field("min_tokens", f"min_tokens ({min_tokens}) must be at most max_tokens ({max_tokens})")
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=read_float(body, "temperature", 1.0, lo=0.0, hi=2.0),
        top_p=read_float(body, "top_p", 1.0, lo=0.0, hi=1.0, is_lo_open=True),
        top_k=max(0, top_k or 0),
        seed=read_int(body, "seed", None, lo=0, hi=MAX_SEED),
        stop=read_stop(body, MAX_STOP_SEQUENCES),
        ignore_eos=read_bool(body, "ignore_eos", False),
        stop_token_ids=read_int_list(body, "stop_token_ids", MAX_STOP_TOKEN_IDS),
        presence_penalty=read_float(body, "presence_penalty", 0.0, lo=-MAX_PENALTY, hi=MAX_PENALTY),
        frequency_penalty=read_float(body, "frequency_penalty", 0.0, lo=-MAX_PENALTY, hi=MAX_PENALTY),
        repetition_penalty=read_float(body, "repetition_penalty", 1.0, lo=0.0, hi=MAX_REPETITION_PENALTY,
                                      is_lo_open=True),
        min_p=read_float(body, "min_p", 0.0, lo=0.0, hi=1.0),
        logit_bias=read_logit_bias(body, MAX_LOGIT_BIAS_ENTRIES),
        min_tokens=min_tokens,
        include_stop_str_in_output=read_bool(body, "include_stop_str_in_output", False),
        skip_special_tokens=read_bool(body, "skip_special_tokens", True),
    )
