"""Sampling controls across instances (roles/worker/sampling.py): the prefill instance's first token and the decode
loop's tokens follow the penalties over the whole history, also for a migrated leg whose earlier output came from
other instances (tiny random model, store + prefill + decode over RPC)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mooncaked.config import Config
from mooncaked.model.loader import load_model
from mooncaked.roles.base import PeerClients
from mooncaked.roles.worker.messages import (DECODE, PREFILL, RESERVE, DecodeRequest, PrefillRequest, ReserveRequest,
                                             SamplingSpec, TokenBias)
from mooncaked.rpc import InvalidArgument
from tests.model.sampling_reference import reference_adjust
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.roles.engine_reference import greedy_tokens
from tests.roles.test_disagg_roles import keys_for

NUM_TOKENS = 12
PENALIZED = SamplingSpec(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, presence_penalty=0.5,
                         frequency_penalty=1.5, repetition_penalty=1.3, logit_bias=[TokenBias(7, 4.0)])


def reference(prompt: list[int]) -> list[int]:
    def adjust(row: list[float], output: list[int]) -> list[float]:
        return reference_adjust(row, prompt=prompt, output=output, logit_bias=[(7, 4.0)], repetition_penalty=1.3,
                                frequency_penalty=1.5, presence_penalty=0.5)
    return greedy_tokens(load_model("random:tiny"), prompt, NUM_TOKENS, adjust=adjust)


async def run_leg(config: Config, clients: PeerClients, leg_id: str, token_ids: list[int], spec: SamplingSpec, *,
                  is_inline: bool) -> list[int]:
    decode = clients.for_instance(config.instance_named("d0"))
    prefill = clients.for_instance(config.instance_named("p0"))
    keys = keys_for(config, token_ids)
    reserve = await decode.call(RESERVE, ReserveRequest(leg_id, keys, len(token_ids), spec.max_tokens, 10_000,
                                                        is_inline_prefill=is_inline), timeout_s=10)
    assert reserve.is_accepted, reserve.reason
    first = None
    if not is_inline:
        reply = await prefill.call(PREFILL, PrefillRequest(leg_id, token_ids, keys, spec,
                                                           decode_store=reserve.store_instance,
                                                           destinations=reserve.destinations), timeout_s=30)
        first = reply.first_token
    out = [] if first is None else [first.token_id]
    async for item in decode.stream(DECODE, DecodeRequest(leg_id, token_ids, keys, spec, first), timeout_s=30):
        out.extend(t.token_id for t in item.tokens)
    return out


@pytest.mark.parametrize("is_inline", [False, True])
async def test_penalties_follow_the_whole_output_across_prefill_decode_and_a_migration(tmp_path: Path,
                                                                                        is_inline: bool) -> None:
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("p0", "prefill"), instance("d0", "decode")])
    prompt = [random.Random(5).randrange(3, 300) for _ in range(30)]
    expected = reference(prompt)
    assert expected != greedy_tokens(load_model("random:tiny"), prompt, NUM_TOKENS), "the controls changed nothing"
    async with running_roles(config, ["s0", "p0", "d0"]):
        clients = PeerClients(config, config.instance_named("p0"))
        try:
            assert await run_leg(config, clients, "r1", prompt, PENALIZED, is_inline=is_inline) == expected
            num_streamed = 5  # a migrated leg: the prompt plus what the client already has, the seed state after it
            moved = SamplingSpec(**{**PENALIZED.__dict__, "max_tokens": NUM_TOKENS - num_streamed,
                                    "num_sampled": num_streamed})
            rest = await run_leg(config, clients, "r1~1", prompt + expected[:num_streamed], moved,
                                 is_inline=is_inline)
            assert rest == expected[num_streamed:]
        finally:
            await clients.close()


async def test_a_logit_bias_outside_the_vocabulary_is_refused_by_the_instance(tmp_path: Path) -> None:
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("p0", "prefill"), instance("d0", "decode")])
    prompt = list(range(3, 40))
    async with running_roles(config, ["s0", "p0"]):
        clients = PeerClients(config, config.instance_named("p0"))
        try:
            prefill = clients.for_instance(config.instance_named("p0"))
            spec = SamplingSpec(max_tokens=2, logit_bias=[TokenBias(10**6, 1.0)])
            with pytest.raises(InvalidArgument, match="logit_bias"):
                await prefill.call(PREFILL, PrefillRequest("r1", prompt, keys_for(config, prompt), spec), timeout_s=10)
            too_many = SamplingSpec(max_tokens=2, presence_penalty=1.0, num_sampled=len(prompt) + 1)
            with pytest.raises(InvalidArgument, match="num_sampled"):
                await prefill.call(PREFILL, PrefillRequest("r2", prompt, keys_for(config, prompt), too_many),
                                   timeout_s=10)
        finally:
            await clients.close()
