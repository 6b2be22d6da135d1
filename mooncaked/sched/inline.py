"""Inline prefill: a prompt prefilled on its decode instance (the colocated path), and when it replaces Algorithm 1's
placement. The one rule the conductor's placer and the simulator both run.

    place(request, prefill_views, decode_views, index, policy, now, device_index) -> Placement | Rejection

1. No prefill instance at all: every request is prefilled inline, whatever its length (`place_inline` unlimited).
2. Otherwise Algorithm 1 (`schedule`) runs first. When it finds no prefill instance that can take the request,
   an inline prefill is tried on a decode instance whose uncached part of the prompt is at most its
   `inline_max_tokens`; if none takes it, Algorithm 1's rejection stands.
3. When Algorithm 1 placed the request and the chosen decode instance holds all but at most `inline_max_tokens`
   of the prompt in its host's store, the request is prefilled there instead (no transfer, no prefill queue).
4. `place_inline`: the decode instance as Algorithm 1 chooses it (line 17, ready now), its reused prefix from
   the index (the longer of its host store's and its device prefix cache's, `device_index` by `device_id`), its own prefill model, and a TTFT of its compute thread's wait + the forward + its overhead;
   admission is Algorithm 1's at-arrival check (`sched.admission.admission_rejection`). The Placement's
   `prefill_instance` is "".

Pure: no I/O, no clock; same inputs give the same answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mooncaked.sched.admission import admission_rejection, select_decode
from mooncaked.sched.algorithm import SchedulerPolicy, decode_pages, prefix_tokens, schedule, store_prefix_lengths
from mooncaked.sched.predictors import PrefillTimePredictor
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.types import (REASON_NO_DECODE, REASON_NO_PREFILL, DecodeInstanceView, Placement,
                                   PrefillInstanceView, Rejection, RequestInfo)


def place(request: RequestInfo, prefill_views: Sequence[PrefillInstanceView],
          decode_views: Sequence[DecodeInstanceView], index: ShadowIndex, policy: SchedulerPolicy,
          now: float, device_index: ShadowIndex | None = None,
          excluded_stores: frozenset[str] = frozenset()) -> Placement | Rejection:
    """Algorithm 1, or an inline prefill on a decode instance; see the module docstring. `device_index`: the
    prefill instances' device prefix caches (Algorithm 1's local prefix counts them). `excluded_stores`: stores
    whose blocks this request must not reuse (one failed to deliver them)."""
    prefix_lengths = store_prefix_lengths(index, request, excluded_stores)
    device_lengths = device_index.prefix_lengths(request.block_keys) if device_index is not None else {}
    if not prefill_views:
        return place_inline(request, decode_views, prefix_lengths, policy, now, is_limited=False,
                            device_lengths=device_lengths)
    result = schedule(request, prefill_views, decode_views, index, policy, now, device_index, excluded_stores)
    if isinstance(result, Rejection):
        if result.reason != REASON_NO_PREFILL:
            return result
        inline = place_inline(request, decode_views, prefix_lengths, policy, now, is_limited=True,
                              device_lengths=device_lengths)
        return inline if isinstance(inline, Placement) else result
    decode = next(view for view in decode_views if view.instance_id == result.decode_instance)
    if result.decode_defer_s > 0:  # an inline prefill takes its pages now: not while the forecast has none
        return result
    num_local = local_prefix(decode, prefix_lengths, device_lengths)
    if uncached_tokens(request, num_local, policy) <= decode.inline_max_tokens:
        return place_inline(request, [decode], prefix_lengths, policy, now, is_limited=False,
                            device_lengths=device_lengths)
    return result


def local_prefix(view: DecodeInstanceView, prefix_lengths: Mapping[str, int],
                 device_lengths: Mapping[str, int]) -> int:
    """A decode instance's reusable prefix: the longer of its host store's and its device prefix cache's."""
    device = device_lengths.get(view.device_id, 0) if view.device_id else 0
    return max(prefix_lengths.get(view.store_id, 0), device)


def place_inline(request: RequestInfo, decode_views: Sequence[DecodeInstanceView],
                 prefix_lengths: Mapping[str, int], policy: SchedulerPolicy, now: float,
                 is_limited: bool, device_lengths: Mapping[str, int] | None = None) -> Placement | Rejection:
    """Prefill on the decode instance Algorithm 1 would choose; `is_limited`: only when its uncached part of the
    prompt is at most its `inline_max_tokens` (else REASON_NO_PREFILL)."""
    config, predictors = policy.config, policy.predictors
    choice = select_decode(request.num_prompt_tokens, decode_views, config, predictors.decode, now, now,
                           num_pages=decode_pages(request, config, is_inline_prefill=True),
                           num_output_tokens=request.predicted_output_tokens,
                           num_sequences=request.num_sequences)
    if choice.view is None:
        return Rejection(request.request_id, REASON_NO_DECODE)
    view = choice.view
    num_blocks = local_prefix(view, prefix_lengths, device_lengths or {})
    if is_limited and uncached_tokens(request, num_blocks, policy) > view.inline_max_tokens:
        return Rejection(request.request_id, REASON_NO_PREFILL)
    model = PrefillTimePredictor(view.prefill_coefficients) if view.prefill_coefficients else predictors.prefill
    num_prefix_tokens = prefix_tokens(request.num_prompt_tokens, num_blocks, config.block_size)
    prefill_s = model.predict(request.num_prompt_tokens, num_prefix_tokens)
    ttft_s = view.inline_wait_s + prefill_s + view.inline_overhead_s
    rejection = admission_rejection(request.request_id, config, ttft_s, choice)
    if rejection is not None:
        return rejection
    return Placement(request.request_id, "", view.instance_id, num_blocks, num_blocks, None, 0,
                     0.0, 0.0, prefill_s, ttft_s, choice.predicted_tbt_s)


def uncached_tokens(request: RequestInfo, num_prefix_blocks: int, policy: SchedulerPolicy) -> int:
    """The prompt's tokens a prefill computes when `num_prefix_blocks` blocks are reused."""
    return request.num_prompt_tokens - prefix_tokens(request.num_prompt_tokens, num_prefix_blocks,
                                                     policy.config.block_size)
