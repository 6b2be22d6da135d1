"""A worker's constrained decoding: the model's vocabulary as llguidance sees it, and the mask thread
(docs/api.md#structured-outputs; model/grammar.py holds the engine's side).

1. `WorkerGrammar.build(tokenizer, vocab_size, eos_token_ids)` at the worker's start (off the event loop): the
   grammar tokenizer and one mask thread.
2. `state_for(spec, token_ids)`: a sequence's GrammarState, rebuilt from its output so far (a leg's last
   `num_sampled` tokens), or None for a request without a grammar; InvalidArgument when the grammar does not
   compile or refuses that output. Callers build it when the request arrives, never inside a batch.
3. `masks(states)` computes the next token's mask of every constrained row on the mask thread and returns a
   future: the compute thread submits it before the forward and collects it after, so the masks overlap the
   forward (llguidance releases the GIL while it computes one).
4. `close()` shuts the mask thread down (the worker's stop).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

import torch

from mooncaked.model.grammar import GrammarError, GrammarState, GrammarTokenizer
from mooncaked.model.tokenizer import TextTokenizer
from mooncaked.roles.worker.messages import SamplingSpec
from mooncaked.rpc import InvalidArgument

Masks = concurrent.futures.Future[list[torch.Tensor | None]]


class WorkerGrammar:
    """Owns the grammar tokenizer and the mask thread; the states belong to their sequences."""

    def __init__(self, tokenizer: GrammarTokenizer) -> None:
        self.tokenizer = tokenizer
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    @classmethod
    def build(cls, tokenizer: TextTokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> WorkerGrammar:
        return cls(GrammarTokenizer(tokenizer, vocab_size, eos_token_ids))

    def state_for(self, spec: SamplingSpec, token_ids: Sequence[int]) -> GrammarState | None:
        if not spec.grammar:
            return None
        if not 0 <= spec.num_sampled <= len(token_ids):
            raise InvalidArgument(f"num_sampled {spec.num_sampled} does not fit the leg's {len(token_ids)} tokens")
        output = token_ids[len(token_ids) - spec.num_sampled:]
        try:
            return GrammarState(self.tokenizer, spec.grammar, output)
        except GrammarError as exc:
            raise InvalidArgument(f"grammar: {exc}") from None

    def masks(self, states: Sequence[GrammarState | None]) -> Masks:
        if all(state is None for state in states):
            done: Masks = concurrent.futures.Future()
            done.set_result([None] * len(states))
            return done
        return self._thread.submit(_masks, list(states))

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)


def follow_first_token(grammar: GrammarState, token_id: int) -> None:
    """Advance a decode instance's state by the first token, which the prefill instance sampled under the same
    grammar (InvalidArgument when it does not follow it)."""
    try:
        grammar.advance(token_id)
    except GrammarError as exc:
        raise InvalidArgument(f"first_token: {exc}") from None


def _masks(states: list[GrammarState | None]) -> list[torch.Tensor | None]:
    return [None if state is None else state.logit_mask() for state in states]
