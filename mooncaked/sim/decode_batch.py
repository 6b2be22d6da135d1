"""A decode instance's continuous batching on virtual time.

1. `kv_ready_at`: a request handed over after its prefill is ready to decode once the part of its KV stream not
   hidden behind the prefill and the load into HBM are done.
2. `admit_waiting`: at each step's start, waiting requests join the running batch in order while it has room (a
   batch slot and their KV pages); how long one waited once its KV was loaded counts as one of its token gaps, or,
   when its decode start was deferred (the conductor holds its first token back until then), in its TTFT.
3. `advance_one_token`: a step gives every running request one token and one token gap (the gap from the
   prefill's first token counts only with `run.tbt_counts_handoff`); the finished leave the batch.
"""

from __future__ import annotations

from mooncaked.sim.cluster import DecodeInstance, DecodeSeq
from mooncaked.sim.costs import CostModel


def kv_ready_at(now: float, num_prompt_tokens: int, prefill_compute_s: float, costs: CostModel) -> float:
    kv_bytes = num_prompt_tokens * costs.kv_bytes_per_token
    stream_s = max(0.0, kv_bytes / costs.link_bandwidth - prefill_compute_s)
    return now + stream_s + kv_bytes / costs.h2d_bandwidth


def admit_waiting(decode: DecodeInstance, now: float) -> list[DecodeSeq]:
    """The requests that joined the batch."""
    admitted: list[DecodeSeq] = []
    while decode.waiting and decode.has_room_for(decode.waiting[0]):
        seq = decode.waiting.popleft()
        admitted.append(seq)
        decode.incoming.pop(seq.request_index, None)
        if now > seq.ready_at and not seq.is_first_token_held:  # the user saw that pause after the first token
            seq.gaps.append(now - seq.ready_at)
        seq.started_at = now
        decode.running[seq.request_index] = seq
        decode.num_context_tokens += seq.context_tokens
    return admitted


def advance_one_token(decode: DecodeInstance, now: float, counts_handoff: bool) -> list[DecodeSeq]:
    """The requests that finished with this step, removed from the batch."""
    finished: list[DecodeSeq] = []
    for seq in decode.running.values():
        if counts_handoff or seq.is_past_handoff:
            seq.gaps.append(now - seq.last_token_at)
        seq.is_past_handoff = True
        seq.last_token_at = now
        seq.num_tokens_left -= 1
        seq.context_tokens += 1
        if seq.num_tokens_left <= 0:
            finished.append(seq)
    decode.num_context_tokens += len(decode.running)
    for seq in finished:
        del decode.running[seq.request_index]
        decode.num_context_tokens -= seq.context_tokens
    return finished
