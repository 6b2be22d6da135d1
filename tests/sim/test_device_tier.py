"""The simulator's device tier: the engine's policy over page ids (reads in place, keeps finished blocks, evicts
only unread pages) and the tier study's per-tier hit rates on a conversation-shaped trace."""

from __future__ import annotations

import math

from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sim.config import SimConfig, with_overrides
from mooncaked.sim.device_tier import DeviceTier
from mooncaked.sim.engine import Simulator
from mooncaked.sim.tier_study import format_rows, run_tier_study
from mooncaked.sim.trace import TraceRequest


def test_blocks_stay_read_in_place_and_only_unread_pages_are_evicted() -> None:
    index = ShadowIndex()
    tier = DeviceTier("p0", 6, index)
    assert tier.start(0, (1, 2, 3), 4) == 0
    tier.finish(0, (1, 2, 3))
    assert tier.cache.num_cached == 3 and tier.num_free == 6
    assert index.prefix_lengths((1, 2, 3, 9)) == {"p0": 3}  # the device index hears of them
    assert tier.start(1, (1, 2), 3) == 2  # reads blocks 1 and 2, takes one of the 3 free pages
    assert tier.num_free == 3  # 2 free, block 3's page unread
    assert tier.start(2, (7, 8), 3) == 0  # the 2 free pages and block 3's, evicted
    assert 3 not in tier.cache and 1 in tier.cache and 2 in tier.cache
    assert index.prefix_lengths((1, 2, 3)) == {"p0": 2}
    assert tier.start(3, (5,), 1) == 0 and tier.num_free == 0  # blocks 1 and 2 are read: never evicted
    assert 1 in tier.cache and 2 in tier.cache
    tier.cache.check()
    for job, keys in ((1, (1, 2)), (2, (7, 8)), (3, (5,))):
        tier.finish(job, keys)
    assert tier.num_free == 6 and tier.cache.num_referenced == 0
    assert {1, 2, 7, 8} <= set(tier.cache.keys())  # job 3 got no page, so cached nothing


def conversation_trace(num_conversations: int, num_turns: int) -> list[TraceRequest]:
    """Turn t of conversation c: its previous turn's blocks plus two more, a second apart; conversations interleave."""
    requests: list[TraceRequest] = []
    for turn in range(num_turns):
        for c in range(num_conversations):
            blocks = tuple(1000 * c + b for b in range(2 * (turn + 1)))
            requests.append(TraceRequest(len(requests), turn * 1.0 + c * 0.01, len(blocks) * 512, 2, blocks))
    return requests


def test_the_tier_study_counts_device_hits_only_with_the_tier() -> None:
    config = with_overrides(SimConfig(), "cluster", num_prefill=2, num_decode=2, dram_blocks_per_host=8)
    result = run_tier_study(conversation_trace(6, 5), config, device_blocks=64)
    off, on = result["rows"]
    assert off["device_hit_rate"] == 0.0 and on["device_hit_rate"] > 0.2
    for row in (off, on):
        total = row["device_hit_rate"] + row["local_store_hit_rate"] + row["remote_store_hit_rate"]
        assert math.isclose(total + row["computed_rate"], 1.0)
    # 8 DRAM blocks per host hold little of 6 conversations; 64 device pages hold most: fewer blocks computed
    assert on["computed_rate"] < off["computed_rate"]
    assert "| on | 64 |" in format_rows(result["rows"])


def test_decode_instances_keep_and_read_the_device_tier() -> None:
    """Inline prefills (a turn's 2 new blocks fit inline_prefill_max_tokens) read the decode instance's device tier,
    which holds the conversation's earlier turns; and every request's KV stays on the decode instance it ran on."""
    config = with_overrides(SimConfig(), "cluster", num_prefill=1, num_decode=2, dram_blocks_per_host=8,
                            inline_prefill_max_tokens=1024)
    off, on = run_tier_study(conversation_trace(6, 5), config, device_blocks=64)["rows"]
    assert off["device_hit_rate"] == 0.0 and on["device_hit_rate"] > 0.2
    assert on["computed_rate"] < off["computed_rate"]
    simulator = Simulator(with_overrides(config, "cluster", device_prefix_blocks=64), conversation_trace(3, 2))
    records = simulator.run().records
    assert any(r.is_inline and r.device_blocks > 0 for r in records)
    for decode in simulator.decode:
        assert decode.device is not None and decode.device.cache.num_referenced == 0  # every request ended
        decode.device.cache.check()
    cached = {key for decode in simulator.decode if decode.device is not None for key in decode.device.cache.keys()}
    assert {0, 1, 2, 3} <= cached  # conversation 0's second turn: its 4 blocks, on the decode instance it ran on
