"""A restarted conductor's earlier reservations are dropped on its first call, not at their lease's end."""

from __future__ import annotations

from pathlib import Path

from mooncaked.roles.base import PeerClients
from mooncaked.roles.worker.messages import LOAD, RESERVE, LoadRequest, ReserveRequest
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles


async def test_a_new_conductor_run_drops_the_reservations_of_its_earlier_run(tmp_path: Path) -> None:
    # early_rejection: a reservation holds its pages from RESERVE on, so dropping one shows in the free pages
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("d0", "decode"), instance("c0", "conductor"),
                                       instance("c1", "conductor")], scheduler={"admission": "early_rejection"})
    async with running_roles(config, ["s0", "d0"]):
        as_c0 = PeerClients(config, config.instance_named("c0"))
        as_c1 = PeerClients(config, config.instance_named("c1"))
        try:
            decode_c0 = as_c0.for_instance(config.instance_named("d0"))
            decode_c1 = as_c1.for_instance(config.instance_named("d0"))
            idle = await decode_c0.call(LOAD, LoadRequest(), timeout_s=5)
            for request_id, client, run in (("old", decode_c0, 7), ("unknown", decode_c0, 0), ("other", decode_c1, 3)):
                reply = await client.call(RESERVE, ReserveRequest(request_id, [], 40, 8, 600_000, is_inline_prefill=True,
                                                                  conductor_run=run), timeout_s=5)
                assert reply.is_accepted, reply.reason
            same_run = await decode_c0.call(LOAD, LoadRequest(7), timeout_s=5)
            assert same_run.num_waiting == 3
            other_caller = await decode_c1.call(LOAD, LoadRequest(4), timeout_s=5)  # c1's own run 3 goes
            assert other_caller.num_waiting == 2
            restarted = await decode_c0.call(LOAD, LoadRequest(8), timeout_s=5)
            assert restarted.num_waiting == 1  # only c0's run-less reservation is left: no run to compare
            pages_each = (idle.num_free_pages - same_run.num_free_pages) // 3
            assert pages_each > 0 and restarted.num_free_pages == idle.num_free_pages - pages_each
        finally:
            await as_c0.close()
            await as_c1.close()
