"""Log-probabilities as the HTTP layer shows them: token text beside each id (docs/api.md#echo-and-prompt-logprobs).

1. `token_logprobs(tokenizer, samples)`: the sampled tokens' (`logprobs` of completions and chat).
2. `prompt_logprobs(tokenizer, prompt_ids, samples)`: the prompt's, the first token without one (nothing comes
   before it), the others as the prefill instance computed them (`PrefillReply.prompt_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence

from mooncaked.api.backend import PromptLogprob, TokenLogprob
from mooncaked.model.tokenizer import TextTokenizer
from mooncaked.roles.worker.messages import TokenSample


def token_logprobs(tokenizer: TextTokenizer, samples: Sequence[TokenSample]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(_text(tokenizer, s.token_id), s.logprob,
                     tuple((_text(tokenizer, t), lp) for t, lp in zip(s.top_token_ids, s.top_logprobs)))
        for s in samples)


def prompt_logprobs(tokenizer: TextTokenizer, prompt_ids: Sequence[int],
                    samples: Sequence[TokenSample]) -> tuple[PromptLogprob, ...]:
    first = PromptLogprob(prompt_ids[0], _text(tokenizer, prompt_ids[0]), None)
    return (first, *(PromptLogprob(s.token_id, _text(tokenizer, s.token_id), s.logprob, s.rank or None,
                                   tuple((t, _text(tokenizer, t), lp) for t, lp in zip(s.top_token_ids,
                                                                                         s.top_logprobs)))
                     for s in samples))


def _text(tokenizer: TextTokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)
