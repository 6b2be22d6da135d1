"""DECODE without a first token: the prompt prefilled on the decode instance itself (the colocated path).

1. `run(request, reservation, ctx, grammars)` plans the prompt's KV (its prefix from this host's store or the
   device tier, pages taken over from the reservation), runs the forward on the compute thread, awaits the
   layer writes, commits the blocks to the store and marks them complete; on any failure the plan is closed
   uncommitted.
2. The forward is a sample of the instance's prefill model; the rest of the call's time but the wait for the
   compute thread (planning, writes) is the inline overhead LOAD reports (`overhead`). The conductor predicts that
   wait itself (the running decode step's remainder and the inline prefills queued ahead), so it is left out
   rather than averaged over busy and idle moments.
"""

from __future__ import annotations

import time

from mooncaked.model.grammar import GrammarState
from mooncaked.roles.worker.decode.reservations import Reservation
from mooncaked.roles.worker.kv.plan import KvPlan, plan_prompt_kv
from mooncaked.roles.worker.kv.request_kv import RequestKv
from mooncaked.roles.worker.messages import DecodeRequest, SamplingSpec
from mooncaked.roles.worker.prefill.forward import ForwardResult, run_prefill_forward
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import CallContext
from mooncaked.sched.perf_model import RecentMean


class InlinePrefill:
    """Owns the count of inline prefills under way and the recent inline overhead; the worker is the DecodeRole's."""

    def __init__(self, worker: Worker, transfer_timeout_s: float) -> None:
        self.worker = worker
        self.transfer_timeout_s = transfer_timeout_s
        self.num_running = 0
        self.overhead = RecentMean()

    async def run(self, request: DecodeRequest, reservation: Reservation, ctx: CallContext,
                  grammars: list[GrammarState | None]) -> tuple[RequestKv, ForwardResult, int]:
        """(the request's KV, the forward's result, the prompt tokens reused)."""
        worker, started = self.worker, time.monotonic()
        plan = await plan_prompt_kv(worker, request.request_id, list(request.token_ids), request.block_keys,
                                    timeout_s=max(ctx.deadline - time.monotonic(), 0.001),
                                    num_extra_tokens=request.sampling.max_tokens, key_isolation=request.key_isolation,
                                    tenant=request.tenant, reuses_prefix=request.sampling.num_prompt_logprobs is None,
                                    reserved_by=reservation.owner)
        self.num_running += 1
        try:
            submitted = time.monotonic()
            result, forward_start, forward_s = await worker.compute(_timed_forward, worker, plan, request.sampling,
                                                                    grammars)
            await plan.kv.wait_writes(self.transfer_timeout_s)
            await plan.close_store(commit=True)
            plan.kv.mark_complete()
        except BaseException:
            await plan.close(commit=False)
            raise
        finally:
            self.num_running -= 1
        num_prefix_tokens = plan.num_prefix_blocks * worker.block_size
        worker.perf.add_prefill(len(request.token_ids), num_prefix_tokens, forward_s)
        self.overhead.add(time.monotonic() - started - forward_s - (forward_start - submitted))
        return plan.kv, result, num_prefix_tokens


def _timed_forward(worker: Worker, plan: KvPlan, sampling: SamplingSpec,
                   grammars: list[GrammarState | None]) -> tuple[ForwardResult, float, float]:
    """Compute thread: an inline prefill's forward, when it started and its own time (no wait for the thread)."""
    started = time.monotonic()
    result = run_prefill_forward(worker, [plan], [sampling], [grammars])
    return result, started, time.monotonic() - started
