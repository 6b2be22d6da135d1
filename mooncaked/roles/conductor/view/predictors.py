"""The conductor's predictors: every instance's own fitted performance model, from its LOAD replies (section 4.1).

1. Instances profile themselves before they report ready and refit from live measurements (sched/perf_model.py);
   each LOAD reply carries the coefficients. `report()` keeps the latest per instance, so a conductor predicts
   with measured models from its first request, and again at once after a restart: it holds no state of its own.
2. The defaults (the model's shape over an assumed device, or a fit of `scheduler.prefill_profile`) serve only
   while no instance has reported a fitted model.
3. `prefill_for(name)` / `decode_for(name)`: that instance's model, else the newest any instance reported, else
   the default; `current` is the policy's default set, with the newest reported models in it.
"""

from __future__ import annotations

import dataclasses

from mooncaked.sched.predictors import DecodeStepPredictor, Predictors, PrefillTimePredictor


class LivePredictors:
    """Owns the default predictors and the latest model each instance reported."""

    def __init__(self, defaults: Predictors) -> None:
        self.defaults = defaults
        self.current = defaults
        self._prefill: dict[str, PrefillTimePredictor] = {}
        self._decode: dict[str, DecodeStepPredictor] = {}
        self.num_reports = 0

    def report(self, instance: str, prefill: list[float], decode: list[float]) -> None:
        """One LOAD reply's coefficients ([] when that model is not fitted yet); malformed ones are ignored."""
        changed = False
        if len(prefill) == 6 and prefill != list(self._coefficients(self._prefill.get(instance))):
            self._prefill[instance] = PrefillTimePredictor(tuple(prefill))
            self.current = dataclasses.replace(self.current, prefill=self._prefill[instance])
            changed = True
        if len(decode) == 3 and decode != list(self._coefficients(self._decode.get(instance))):
            c0, c1, c2 = decode
            self._decode[instance] = DecodeStepPredictor((c0, c1, c2))
            self.current = dataclasses.replace(self.current, decode=self._decode[instance])
            changed = True
        self.num_reports += changed

    @staticmethod
    def _coefficients(model: PrefillTimePredictor | DecodeStepPredictor | None) -> tuple[float, ...]:
        return () if model is None else model.coefficients

    def forget(self, instance: str) -> None:
        """An instance left the cluster: its model is no longer used."""
        self._prefill.pop(instance, None)
        self._decode.pop(instance, None)

    def prefill_for(self, instance: str) -> PrefillTimePredictor:
        return self._prefill.get(instance, self.current.prefill)

    def decode_for(self, instance: str) -> DecodeStepPredictor:
        return self._decode.get(instance, self.current.decode)

    def has_model(self, instance: str) -> dict[str, bool]:
        return {"prefill": instance in self._prefill, "decode": instance in self._decode}
