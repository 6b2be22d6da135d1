"""The decode side of a simulation run: each decode instance's continuous-batching steps and inline prefills.

1. `on_decode_ready` (DECODE_READY): a prefilled request's KV is in the decode instance's pages (engine.py's
   hand-over); it waits for the next step, which starts now if the instance is idle.
2. `start_step`: the waiting sequences join the batch (decode_batch.admit_waiting; a request whose decode start
   was deferred sends its first token now), and the inline prefills queued since the last step run in this one,
   before its decode; the step lasts the cost model's decode time plus theirs (DECODE_STEP at its end).
3. `on_decode_step`: every running sequence gets one token gap (advance_one_token); a finished one goes to
   `finish`; each of the step's inline prefills gives its request's first token (it joins the batch at the next
   step); then the next step starts.
4. `place_inline`: an inline placement, queued for its decode instance's next step (its prefix read from the
   instance's device tier first, when it has one).
Owns nothing: the engine owns the instances, records and the event queue it pushes to.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from mooncaked.sched.types import Placement
from mooncaked.sim.cluster import DecodeInstance, DecodeSeq
from mooncaked.sim.config import SimConfig
from mooncaked.sim.costs import CostModel
from mooncaked.sim.decode_batch import admit_waiting, advance_one_token
from mooncaked.sim.pool import PoolPolicies
from mooncaked.sim.prefill_side import Push
from mooncaked.sim.results import RequestRecord, tbt_of
from mooncaked.sim.trace import TraceRequest

OnFinished = Callable[[RequestRecord, float, float], None]


class DecodeSide:
    """See the module docstring."""

    def __init__(self, config: SimConfig, costs: CostModel, pool: PoolPolicies, records: list[RequestRecord],
                 requests: Sequence[TraceRequest], instances: Mapping[str, DecodeInstance],
                 noisy: Callable[[float], float], push: Push, step_kind: int, finish: OnFinished) -> None:
        self.config = config
        self.costs = costs
        self.pool = pool
        self.records = records
        self.requests = requests
        self.instances = instances
        self.noisy = noisy
        self.push = push
        self.step_kind = step_kind
        self.finish = finish

    def on_decode_ready(self, now: float, payload: tuple[DecodeInstance, DecodeSeq]) -> None:
        decode, seq = payload
        decode.waiting.append(seq)
        if not decode.is_stepping:
            self.start_step(now, decode)

    def start_step(self, now: float, decode: DecodeInstance) -> None:
        for seq in admit_waiting(decode, now):
            if seq.is_first_token_held:  # its first token goes out as its decode starts
                record = self.records[seq.request_index]
                record.ttft_s = max(record.ttft_s, now - record.arrival_s)
        decode.inline_in_step, decode.inline = decode.inline, []
        if not decode.running and not decode.inline_in_step:
            decode.is_stepping = False
            decode.step_time_s = 0.0
            return
        step_s = 0.0
        if decode.running:
            step_s = self.costs.predictors.decode.predict(len(decode.running), decode.num_context_tokens)
        decode.step_time_s = step_s + sum(compute_s for _, compute_s in decode.inline_in_step)
        decode.is_stepping = True
        self.push(now + decode.step_time_s, self.step_kind, decode)

    def on_decode_step(self, now: float, decode: DecodeInstance) -> None:
        for seq in advance_one_token(decode, now, self.config.run.tbt_counts_handoff):
            self.finish(self.records[seq.request_index], now, tbt_of(seq.gaps))
        for request_index, compute_s in decode.inline_in_step:
            self._inline_done(now, decode, request_index, compute_s)
        decode.inline_in_step = []
        self.start_step(now, decode)

    def place_inline(self, now: float, request: TraceRequest, placement: Placement, record: RequestRecord) -> None:
        """Prefill on the decode instance: queued for its next step, which runs it before decoding."""
        decode = self.instances[placement.decode_instance]
        self.pool.note_use(decode.store.store_id, request.hash_ids, placement.num_prefix_blocks, now)
        record.prefill_instance = record.decode_instance = decode.instance_id
        record.is_inline = True
        record.prefix_blocks = record.local_prefix_blocks = placement.num_prefix_blocks
        if decode.device is not None:
            num_device = decode.device.start_prompt(request.index, request.hash_ids, request.input_length,
                                                    self.config.scheduler.block_size)
            record.device_blocks = min(num_device, placement.num_prefix_blocks)
        decode.incoming[request.index] = (now + placement.predicted_decode_start_s, request.input_length)
        decode.inline.append((request.index, self.noisy(placement.predicted_prefill_s)))
        if not decode.is_stepping:
            self.start_step(now, decode)

    def _inline_done(self, now: float, decode: DecodeInstance, request_index: int, compute_s: float) -> None:
        """The first token of an inline prefill: the request joins the batch at the next step."""
        record = self.records[request_index]
        record.prefill_compute_s = compute_s
        record.ttft_s = now - record.arrival_s
        if self.config.cluster.decode_hosts_in_pool:
            decode.store.put(self.requests[request_index].hash_ids, now)
        if record.output_length <= 1:
            decode.incoming.pop(request_index, None)
            self.finish(record, now, 0.0)
            return
        seq = DecodeSeq(request_index, record.input_length + 1, record.output_length - 1, now, ready_at=now)
        decode.incoming[request_index] = (now, seq.context_tokens)
        decode.waiting.append(seq)
