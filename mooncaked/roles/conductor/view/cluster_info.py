"""GET /v1/cluster: the conductor's view as JSON (instances and their reported models, stores, the index, the
in-flight legs, the scheduler and the membership)."""

from __future__ import annotations

import asyncio
from typing import Any

from mooncaked.roles.conductor.view.cluster import ClusterView
from mooncaked.roles.conductor.view.instances import WorkerState
from mooncaked.roles.conductor.view.store_follower import StoreFollower
from mooncaked.rpc import RpcError
from mooncaked.store import messages as kv_msg


async def describe_cluster(view: ClusterView) -> dict[str, Any]:
    stats = await asyncio.gather(*(_store_stats(f, view.settings.poll_timeout_s) for f in view.followers.values()))
    stores = [{"name": f.store.name, "host": f.store.host, "is_up": f.is_up, "last_seq": f.last_seq,
               "num_resyncs": f.num_resyncs, "num_indexed_blocks": view.index.num_blocks(f.store.name),
               "stats": s, "last_error": f.last_error} for f, s in zip(view.followers.values(), stats)]
    prefill_waiting, decode_incoming = view.num_waiting()
    return {
        "instances": [_describe_worker(w, view.block_size) for w in view.workers],
        "prefill_groups": [{"name": group.name, "members": group.members, "is_ready": view.is_group_ready(head)}
                           for head, group in view.groups.items()],
        "membership": view.membership.status().as_dict(),
        "stores": stores,
        "prefix_blocks": dict(view.prefix_blocks),
        "index": {"num_keys": view.index.num_keys, "stale_stores": sorted(view.index.stale_stores())},
        "in_flight": {"total": len(view.flights), "prefill_waiting": prefill_waiting,
                      "decode_incoming": decode_incoming},
        "scheduler": {"policy": view.policy_config.scheduler, "admission": view.policy_config.admission,
                      "num_model_reports": view.predictors.num_reports,
                      "num_output_lengths_observed": view.output_lengths.num_observed},
    }


def _describe_worker(worker: WorkerState, block_size: int) -> dict[str, Any]:
    load = worker.load
    return {"name": worker.instance.name, "role": worker.instance.role, "host": worker.instance.host,
            "port": worker.instance.port, "store": worker.store_id, "is_up": worker.is_up, "state": worker.state,
            "last_error": worker.last_error,
            "model": None if load is None else {"prefill_coefficients": load.prefill_coefficients,
                                                "decode_coefficients": load.decode_coefficients,
                                                "pending_work_s": load.pending_work_s,
                                                "overhead_s": load.overhead_s,
                                                "stage_coefficients": load.stage_coefficients,
                                                "pipeline_stages": load.pipeline_stages,
                                                "pipeline_handoffs_s": load.pipeline_handoffs_s},
            "load": None if load is None else {
                "num_running": load.num_running, "num_waiting": load.num_waiting,
                "num_queued_tokens": load.num_queued_tokens, "num_free_pages": load.num_free_pages,
                "num_pages": load.num_pages, "step_time_s": load.step_time_s,
                "num_context_tokens": load.num_context_tokens},
            "kv_cache": None if load is None else {
                "num_pages": load.num_pages, "num_tokens": load.num_pages * block_size, "bytes": load.kv_cache_bytes}}


async def _store_stats(follower: StoreFollower, timeout_s: float) -> dict[str, int] | None:
    if not follower.is_up:
        return None
    try:
        reply = await follower.client.call(kv_msg.STATS, kv_msg.StatsRequest(),
                                           timeout_s=timeout_s)
    except RpcError:
        return None
    return dict(reply.counters)
