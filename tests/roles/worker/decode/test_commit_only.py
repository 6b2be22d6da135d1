"""A request its prefill's first token ends (max_tokens 1): its decode instance takes no KV page and no batch slot,
and only commits the prefilled blocks to its host's store (sched/decode_memory.is_decoding)."""

from __future__ import annotations

import random
from pathlib import Path

from mooncaked.model.loader import load_model
from mooncaked.roles.base import PeerClients
from mooncaked.roles.worker.decode.role import DecodeRole
from mooncaked.roles.worker.messages import (DECODE, PREFILL, RESERVE, DecodeRequest, PrefillRequest, ReserveRequest,
                                             SamplingSpec)
from mooncaked.rpc import RpcClient
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.roles.engine_reference import greedy_tokens
from tests.roles.test_disagg_roles import keys_for


async def test_first_token_only_takes_no_page_and_commits_its_blocks(tmp_path: Path) -> None:
    config = cluster_config(tmp_path, [instance("s2", "store", "127.0.0.2"), instance("p0", "prefill", "127.0.0.2"),
                                       instance("s3", "store", "127.0.0.3"),
                                       instance("d0", "decode", "127.0.0.3",
                                                settings={"num_kv_pages": 4, "max_batch_size": 1})])
    tokens = [random.Random(5).randrange(3, 300) for _ in range(100)]  # 6 full blocks of 16 and a tail of 4
    keys = keys_for(config, tokens)
    expected = greedy_tokens(load_model("random:tiny"), tokens, 1)
    spec = SamplingSpec(max_tokens=1, temperature=0.0)
    async with running_roles(config, ["s2", "s3", "p0", "d0"]) as roles:
        clients = PeerClients(config, config.instance_named("p0"))
        decode_role = roles["d0"]
        assert isinstance(decode_role, DecodeRole)
        pages = decode_role.worker.pages
        assert pages is not None
        try:
            decode: RpcClient = clients.for_instance(config.instance_named("d0"))
            prefill: RpcClient = clients.for_instance(config.instance_named("p0"))
            # it decodes: 7 pages and a slot, more than the instance has
            refused = await decode.call(RESERVE, ReserveRequest("big", keys, len(tokens), 8, 10_000), timeout_s=10)
            assert not refused.is_accepted and "the instance has 4" in refused.reason
            for request_id, num_present in (("r1", 0), ("r2", 6)):
                reserve = await decode.call(RESERVE, ReserveRequest(request_id, keys, len(tokens), 1, 10_000),
                                            timeout_s=10)
                assert reserve.is_accepted, reserve.reason
                assert reserve.num_present_blocks == num_present  # r1's DECODE committed them on d0's host
                assert all(d.block_index < 6 for d in reserve.destinations)  # no tail block: nothing decodes
                assert len(decode_role.reservations) == 1 and decode_role.reservations.num_sequences() == 0
                reply = await prefill.call(PREFILL, PrefillRequest(request_id, tokens, keys, spec,
                                                                   decode_store=reserve.store_instance,
                                                                   destinations=reserve.destinations), timeout_s=30)
                assert reply.first_token.token_id == expected[0]
                items = [item async for item in decode.stream(
                    DECODE, DecodeRequest(request_id, tokens, keys, spec, reply.first_token), timeout_s=30)]
                assert [(i.tokens, i.finish_reason) for i in items] == [([], "length")]
                assert pages.num_free == pages.num_pages and len(decode_role.reservations) == 0
        finally:
            await clients.close()
