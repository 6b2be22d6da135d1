"""RESERVE on a simulated decode instance: the decode role's rules (sched/decode_admission.py,
sched/decode_memory.py) over the simulator's state.

1. `refusal` answers a RESERVE call ("" when it takes the request): under `early_rejection_predicted` the pages
   and batch slots forecast over the request's predicted decode life, from its predicted decode start; otherwise
   the instance's load now (free pages, placed requests counted as running, the TBT SLO under early_rejection).
2. `page_holds` is every sequence's pages over its predicted life, as both the conductor's view and RESERVE's
   forecast read it; `decode_s` a request's predicted decode time there (its predicted output at the step now,
   the uniform t_d without a prediction).
Reads the config and the cost model; owns nothing (the engine owns the instances and the predictions).
"""

from __future__ import annotations

from collections.abc import Mapping

from mooncaked.sched.decode_admission import StepLimit, reserve_refusal
from mooncaked.sched.decode_memory import DecodeHold, forecast_refusal, is_decoding, num_pages_for
from mooncaked.sched.types import Placement
from mooncaked.sim.cluster import DecodeInstance
from mooncaked.sim.config import SimConfig
from mooncaked.sim.costs import CostModel


class DecodeReserve:
    """See the module docstring."""

    def __init__(self, config: SimConfig, costs: CostModel) -> None:
        self.config = config
        self.costs = costs

    def refusal(self, decode: DecodeInstance, num_prompt_tokens: int, max_tokens: int, placement: Placement,
                predicted_tokens: int, all_predicted: Mapping[int, int], now: float) -> str:
        """Why RESERVE refuses the request now ("" when it takes it); one that does not decode there
        (decode_memory.is_decoding: its prefill's first token ends it) needs nothing of it."""
        config = self.config.scheduler
        if not is_decoding(max_tokens, is_inline_prefill=not placement.prefill_instance):
            return ""
        num_pages = num_pages_for(num_prompt_tokens, max_tokens, decode.block_size)
        if config.admission == "early_rejection_predicted":
            starts_at = now + placement.predicted_decode_start_s
            new = DecodeHold(num_pages, starts_at, starts_at + self.decode_s(decode, predicted_tokens))
            return forecast_refusal(new, self.page_holds(decode, now, all_predicted), decode.num_pages,
                                    decode.max_num_running)
        return reserve_refusal(config.admission, decode.load_now(), num_pages, num_prompt_tokens,
                               decode.max_num_running, self.step_limit())

    def page_holds(self, decode: DecodeInstance, now: float,
                   predicted_tokens: Mapping[int, int]) -> tuple[DecodeHold, ...]:
        return decode.page_holds(now, predicted_tokens, self._step_s(decode))

    def decode_s(self, decode: DecodeInstance, predicted_tokens: int) -> float:
        if not predicted_tokens:
            return self.config.scheduler.decode_time_s
        return predicted_tokens * self._step_s(decode)

    def step_limit(self) -> StepLimit:
        return StepLimit(self.costs.predictors.decode, 0.0, self.config.scheduler.tbt_slo_s)

    def _step_s(self, decode: DecodeInstance) -> float:
        return self.costs.predictors.decode.predict(len(decode.running) + 1, decode.num_context_tokens)
