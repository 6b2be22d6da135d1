"""A worker's KV pages sized from its memory budget: reported in LOAD and the cluster view, refused at start when
too small for one request; each role keeps the projection copies it uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from mooncaked.config import Config
from mooncaked.config.memory_plan import RUNTIME_BYTES, plan_memory, worker_packing
from mooncaked.engine.kv_budget import MIB, KVBudgetTooSmall, page_nbytes
from mooncaked.model import packed_gemm
from mooncaked.model.config import LayerRange
from mooncaked.model.llama import Linear
from mooncaked.model.memory_fit import weight_bytes
from mooncaked.model.presets import random_preset
from mooncaked.roles import make_role
from mooncaked.roles.base import PeerClients
from mooncaked.roles.worker.decode.role import DecodeRole
from mooncaked.roles.worker.messages import LOAD, LoadRequest
from mooncaked.roles.worker.prefill.role import PrefillRole
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles

TINY_PAGE = page_nbytes(random_preset("tiny"), 16, torch.float32)


def _config(tmp_path: Path, **worker: object) -> Config:
    instances = [instance("s0", "store"), instance("p0", "prefill"), instance("d0", "decode"),
                 instance("c0", "conductor")]
    return cluster_config(tmp_path, instances, worker={"num_kv_pages": None, "profile_s": 1.0, **worker})


async def test_pages_come_from_the_budget_and_are_reported(tmp_path: Path) -> None:
    config = _config(tmp_path, kv_memory_bytes=80 * TINY_PAGE + 5, max_batch_size=4)
    async with running_roles(config, ["s0", "p0", "d0", "c0"]) as roles:
        prefill, decode = roles["p0"], roles["d0"]
        assert isinstance(prefill, PrefillRole) and isinstance(decode, DecodeRole)
        for worker in (prefill.worker, decode.worker):
            assert worker.num_pages == 80 and worker.kv_pages is not None and worker.kv_pages.num_pages == 80
            assert worker.kv_sizing is not None and worker.kv_sizing.origin.startswith("worker.kv_memory_bytes")
        assert decode.worker.perf.num_samples()["decode_profile"] > 0  # the profile fits in the derived pages
        peers = PeerClients(config, config.instance_named("c0"))
        try:
            reply = await peers.for_instance(config.instance_named("d0")).call(LOAD, LoadRequest(), timeout_s=5.0)
        finally:
            await peers.close()
        assert reply.num_pages == 80 and reply.kv_cache_bytes == 80 * TINY_PAGE
        port = config.instance_named("c0").port
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/v1/cluster") as response:
            described = {i["name"]: i for i in (await response.json())["instances"]}
        assert described["p0"]["kv_cache"] == {"num_pages": 80, "num_tokens": 80 * 16, "bytes": 80 * TINY_PAGE}


async def test_a_budget_below_one_request_fails_at_start_saying_what_it_needs(tmp_path: Path) -> None:
    config = _config(tmp_path, kv_memory_bytes=TINY_PAGE * 10)  # max_model_len 1024 needs 64 pages of 16
    async with running_roles(config, ["s0"]):
        role = make_role(config, config.instance_named("d0"))
        try:
            with pytest.raises(KVBudgetTooSmall, match=r"holds 10 KV pages \(160 tokens\) but one request of "
                                                       r"model.max_model_len = 1024 tokens needs 64 pages"):
                await role.start()
        finally:
            await role.stop()


def test_each_role_keeps_the_projection_copies_it_uses() -> None:
    assert worker_packing("prefill", False) == "plain"
    assert worker_packing("decode", False) == "packed"
    assert worker_packing("prefill", True) == worker_packing("decode", True) == "both"  # either role may come


@pytest.mark.skipif(not packed_gemm.is_available(), reason="needs MKL's packed GEMM")
async def test_a_decode_worker_holds_packed_projections_only(tmp_path: Path) -> None:
    config = _config(tmp_path, kv_memory_bytes=2 * MIB, profile_s=0.0)
    async with running_roles(config, ["s0", "p0", "d0"]) as roles:
        prefill, decode = roles["p0"], roles["d0"]
        assert isinstance(prefill, PrefillRole) and isinstance(decode, DecodeRole)
        assert prefill.worker.loaded is not None and decode.worker.loaded is not None
        prefill_linears = [m for m in prefill.worker.loaded.model.modules() if isinstance(m, Linear)]
        decode_linears = [m for m in decode.worker.loaded.model.modules() if isinstance(m, Linear)]
        assert all(m.packed is None and m.weight_t is not None for m in prefill_linears)
        assert all(m.packed is not None and m.weight_t is None for m in decode_linears)


def test_the_memory_plan_counts_every_rank_of_a_tensor_parallel_instance(tmp_path: Path) -> None:
    instances = [instance("s0", "store"), instance("p0", "prefill", settings={"tensor_parallel_size": 2}),
                 instance("d0", "decode")]
    config = cluster_config(tmp_path, instances, model={"share_weights": False, "cpu_packed_gemm": False},
                            worker={"num_kv_pages": None, "kv_memory_bytes": 4 * MIB})
    args = random_preset("tiny")
    plans = {p.instance: p for p in plan_memory(config, args)}
    prefill, decode = plans["p0"], plans["d0"]
    assert prefill.runtime == 2 * RUNTIME_BYTES["prefill"] and prefill.workspace == 2 * decode.workspace
    assert prefill.private_weights == 2 * weight_bytes(args, torch.float32, num_ranks=2)
    assert weight_bytes(args, torch.float32) < prefill.private_weights  # the embedding is on every rank
    assert prefill.kv is not None and decode.kv is not None and prefill.kv.nbytes == decode.kv.nbytes


def test_the_memory_plan_gives_each_gpu_of_a_tensor_parallel_instance_its_ranks_share(tmp_path: Path) -> None:
    """On CUDA the KV budget is each rank's GPU's, over pages of the rank's KV heads (tiny: 1 of 2)."""
    instances = [instance("s0", "store"), instance("p0", "prefill", settings={"tensor_parallel_size": 2}),
                 instance("d0", "decode")]
    config = cluster_config(tmp_path, instances, model={"device": "cuda", "cuda_graphs": False},
                            worker={"num_kv_pages": None, "kv_memory_bytes": 4 * MIB})
    plans = {p.instance: p for p in plan_memory(config, random_preset("tiny"))}
    assert plans["p0"].device_note.startswith("on each of 2 GPUs: ")
    assert plans["d0"].device_note.startswith("on the GPU: ")
    assert f"{4 * MIB // (TINY_PAGE // 2)} pages" in plans["p0"].device_note
    assert f"{4 * MIB // TINY_PAGE} pages" in plans["d0"].device_note
    assert plans["p0"].runtime == 2 * plans["d0"].runtime


def test_the_memory_plan_counts_a_prefill_group_stage_s_layers_only(tmp_path: Path) -> None:
    """A stage holds its layers' weights and KV pages of its layers (tiny: one layer of two per stage)."""
    instances = [instance("s0", "store"), instance("g0", "prefill"), instance("g1", "prefill"),
                 instance("p0", "prefill"), instance("d0", "decode")]
    config = cluster_config(tmp_path, instances, model={"share_weights": False, "cpu_packed_gemm": False},
                            cluster={"prefill_groups": [{"name": "pg", "members": ["g0", "g1"]}]},
                            worker={"num_kv_pages": None, "kv_memory_bytes": 4 * MIB})
    args = random_preset("tiny")
    plans = {p.instance: p for p in plan_memory(config, args)}
    first, second, whole = plans["g0"], plans["g1"], plans["p0"]
    assert first.kv is not None and whole.kv is not None and first.kv.num_pages == 2 * whole.kv.num_pages
    assert first.private_weights == weight_bytes(args, torch.float32, layers=LayerRange(0, 1, 2))
    assert second.private_weights == weight_bytes(args, torch.float32, layers=LayerRange(1, 2, 2))
    assert first.private_weights + second.private_weights > whole.private_weights > first.private_weights


def test_check_config_and_the_transfer_estimate_use_int8_kv_s_size(tmp_path: Path) -> None:
    """kv.cache_dtype int8: the memory plan fits 3.9x the pages in one budget (tiny: head_dim 16 -> 18 bytes a row
    against fp32's 64), the conductor's transfer estimate moves that many fewer bytes per block, and the torch
    backend without tensor parallelism is required."""
    from mooncaked.config.sections import ConfigError
    from mooncaked.config.validate import validate
    from mooncaked.model.frontend import load_frontend
    from mooncaked.roles.conductor.role import default_predictors

    instances = [instance("s0", "store"), instance("p0", "prefill"), instance("d0", "decode")]
    sections: dict[str, Any] = dict(model={"share_weights": False, "cpu_packed_gemm": False},
                                    worker={"num_kv_pages": None, "kv_memory_bytes": 4 * MIB})
    auto = cluster_config(tmp_path, instances, **sections)
    int8 = cluster_config(tmp_path, instances, kv={"block_size": 16, "cache_dtype": "int8"}, **sections)
    args = random_preset("tiny")
    auto_kv, int8_kv = plan_memory(auto, args)[1].kv, plan_memory(int8, args)[1].kv
    assert auto_kv is not None and int8_kv is not None
    assert int8_kv.page_nbytes * 64 == auto_kv.page_nbytes * 18 and int8_kv.num_pages >= 3.5 * auto_kv.num_pages
    frontend = load_frontend(auto.model.source)
    auto_block = default_predictors(auto, frontend).transfer.bytes_per_block
    assert default_predictors(int8, frontend).transfer.bytes_per_block * 64 == auto_block * 18
    assert not validate(int8)
    assert not validate(cluster_config(tmp_path, instances, kv={"cache_dtype": "int8"},
                                       model={"kernel_backend": "triton"}))
    with pytest.raises(ConfigError, match="kv.cache_dtype: int8 KV runs without CUDA graphs"):
        cluster_config(tmp_path, instances, kv={"cache_dtype": "int8"}, model={"cuda_graphs": True})
