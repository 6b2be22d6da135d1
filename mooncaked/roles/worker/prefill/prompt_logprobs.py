"""Prompt logprobs (completions' echo with logprobs, vLLM's prompt_logprobs), from the rows a prefill forward
computes anyway (docs/api.md#echo-and-prompt-logprobs).

1. A prompt whose sampling spec asks for them (`num_prompt_logprobs`) is planned without reusing a cached prefix
   (every position's row is needed) and prefilled alone (prefill/role.py), in chunks of `worker.prefill_chunk`: the
   forward keeps every row's logits, at most a chunk's [tokens, vocab].
2. `collect(logits, cu_seqlens, seqs, specs, into)` reads, for each such prompt, the log-probability of each prompt
   token at the row before it (with the `num_prompt_logprobs` most likely alternatives), in order; the first token
   has none (the reply's list starts at the second).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mooncaked.engine.batch import PrefillSeq
from mooncaked.roles.worker.messages import SamplingSpec, TokenSample


def wants_prompt_logprobs(specs: Sequence[SamplingSpec]) -> bool:
    return any(spec.num_prompt_logprobs is not None for spec in specs)


def collect(logits: torch.Tensor, cu_seqlens: Sequence[int], seqs: Sequence[PrefillSeq],
            prompts: Sequence[Sequence[int]], specs: Sequence[SamplingSpec], into: Sequence[list[TokenSample]]) -> None:
    """logits fp32 [T, vocab], every row of one chunk's forward: append each asking prompt's tokens that these rows
    predict (the row at position p predicts the prompt's token p + 1)."""
    for i, (seq, prompt, spec) in enumerate(zip(seqs, prompts, specs)):
        if spec.num_prompt_logprobs is None:
            continue
        first = seq.num_cached_tokens
        end = min(len(seq.token_ids), len(prompt) - 1 - first)  # the last prompt row predicts no prompt token
        if end <= 0:
            continue
        rows = torch.log_softmax(logits[cu_seqlens[i]: cu_seqlens[i] + end].float(), dim=-1)
        targets = torch.tensor(prompt[first + 1: first + 1 + end], dtype=torch.long, device=rows.device)
        chosen_rows = rows.gather(1, targets.unsqueeze(1))
        ranks = ((rows > chosen_rows).sum(dim=1) + 1).tolist()
        chosen = chosen_rows.squeeze(1).tolist()
        num_top = spec.num_prompt_logprobs
        top = torch.topk(rows, num_top, dim=-1) if num_top else None
        for j, token_id in enumerate(targets.tolist()):
            into[i].append(TokenSample(token_id=token_id, logprob=chosen[j],
                                       top_token_ids=top.indices[j].tolist() if top is not None else [],
                                       top_logprobs=top.values[j].tolist() if top is not None else [],
                                       rank=ranks[j]))
