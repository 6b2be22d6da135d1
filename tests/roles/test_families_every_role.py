"""Qwen3-MoE and DeepSeek-V3 (MLA) served through the roles beyond one prefill and one decode instance: a long
prompt prefilled by a prefill group (chunked pipeline parallelism) equals transformers' greedy text, and a stream
whose decode instance stops mid-way moves to the other decode instance with its text unchanged; an MLA worker
switched from prefill to decode serves the same text."""

from __future__ import annotations

import random
from pathlib import Path

import aiohttp
import pytest

from mooncaked.bench.etcd_server import EtcdServer
from mooncaked.model.loader import load_model
from mooncaked.roles.base import PeerClients
from mooncaked.roles.conductor.role import ConductorRole
from mooncaked.roles.worker.decode.role import DecodeRole
from mooncaked.roles.worker.switch_messages import SWITCH, SwitchRequest
from mooncaked.roles.worker.switching import SwitchableWorkerRole
from tests.cluster.etcd_fixture import etcd, needs_etcd  # noqa: F401
from tests.model.family_checkpoints import CASES, FamilyCase, write_checkpoint
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.roles.test_conductor_flow import GREEDY, completion, eventually, url
from tests.roles.test_cpp_conductor import live_samples
from tests.roles.test_elastic import fleet, instance_of, own_config, wait_until
from tests.roles.test_failover import metric, stream_interrupted
from tests.roles.test_moe_mla_served import _transformers_greedy

pytest.importorskip("transformers")

SERVED = [c for c in CASES if c.model_type in ("qwen3_moe", "deepseek_v3")]
NEW_TOKENS = 12


@pytest.mark.parametrize("case", SERVED, ids=[c.case_id for c in SERVED])
async def test_a_prefill_group_and_a_decode_migration_serve_the_family(case: FamilyCase, tmp_path: Path) -> None:
    checkpoint = tmp_path / case.case_id
    hf = write_checkpoint(case, checkpoint, seed=17)
    rng = random.Random(9)
    long_tokens = [rng.randrange(3, 300) for _ in range(90)]  # past cpp_min_tokens: the group's
    streamed_tokens = [rng.randrange(3, 300) for _ in range(30)]
    tokenizer = load_model(str(checkpoint)).tokenizer
    long_text = tokenizer.decode(_transformers_greedy(hf, long_tokens, NEW_TOKENS))
    streamed_text = tokenizer.decode(_transformers_greedy(hf, streamed_tokens, NEW_TOKENS))
    config = cluster_config(
        tmp_path, [instance("s0", "store"), instance("g0", "prefill"), instance("g1", "prefill"),
                   instance("p1", "prefill"), instance("d0", "decode"), instance("d1", "decode"),
                   instance("c0", "conductor")],
        model={"source": str(checkpoint), "name": case.case_id, "max_model_len": 512,
               "weight_cache_dir": str(tmp_path / "weights")},
        cluster={"prefill_groups": [{"name": "pg", "members": ["g0", "g1"]}]},
        worker={"inline_prefill_max_tokens": 0, "profile_s": 0, "cpp_chunk_tokens": 16},
        scheduler={"cpp_min_tokens": 64},
        conductor={"token_timeout_s": 10.0, "load_poll_interval_s": 0.05})
    async with running_roles(config, ["s0", "g0", "g1", "p1", "d0", "d1", "c0"]) as roles, \
            aiohttp.ClientSession() as http:
        conductor = roles["c0"]
        assert isinstance(conductor, ConductorRole) and conductor.view is not None
        view = conductor.view
        await eventually(lambda: view.is_group_ready("g0"), timeout_s=60.0)
        grouped = await completion(http, config, {"prompt": long_tokens, "max_tokens": NEW_TOKENS, **GREEDY})
        assert grouped["choices"][0]["text"] == long_text and live_samples(roles["g0"]) == 1

        decodes = [roles["d0"], roles["d1"]]

        async def stop_the_streaming_instance() -> None:
            (streaming,) = [role for role in decodes if isinstance(role, DecodeRole) and role.loop.running]
            await streaming.loop.stop()

        body = {"prompt": streamed_tokens, "max_tokens": NEW_TOKENS, "stream": True,
                "stream_options": {"include_usage": True}, **GREEDY}
        streamed, usage = await stream_interrupted(http, url(config, "/v1/completions"), body,
                                                   stop_the_streaming_instance)
        assert streamed == streamed_text and usage["completion_tokens"] == NEW_TOKENS
        assert (await metric(http, config, "mooncaked_migrations_total{")).startswith(
            'mooncaked_migrations_total{cause="decode_lost"} 1.0')


@needs_etcd
async def test_an_mla_instance_switched_from_prefill_to_decode_serves_the_same_text(tmp_path: Path,
                                                                                     etcd: EtcdServer) -> None:
    """A switchable DeepSeek-V3 (MLA) worker switches to decode on the same latent pages and weights; with the
    other decode instance gone, it decodes every request, and the text is transformers'."""
    case = next(c for c in SERVED if c.model_type == "deepseek_v3")
    checkpoint = tmp_path / case.case_id
    hf = write_checkpoint(case, checkpoint, seed=19)
    tokens = [random.Random(3).randrange(3, 300) for _ in range(40)]
    text = load_model(str(checkpoint)).tokenizer.decode(_transformers_greedy(hf, tokens, NEW_TOKENS))
    model = {"source": str(checkpoint), "name": "tiny", "max_model_len": 512,
             "weight_cache_dir": str(tmp_path / "weights")}
    async with fleet(tmp_path, etcd) as f, aiohttp.ClientSession() as http:
        await f.add("s0", "store", model=model)
        await f.add("p0", "prefill", model=model)
        await f.add("p1", "prefill", model=model, worker={"switchable": True})
        await f.add("d0", "decode", model=model)
        await f.add("c0", "conductor", model=model)
        view = f.inner("c0").view
        await wait_until(lambda: {"p0", "p1"} <= {n for n, w in view.prefill.items() if w.is_placeable}
                         and "d0" in view.decode, 5.0, "cluster up")
        worker = f.inner("p1")
        assert isinstance(worker, SwitchableWorkerRole)
        peers = PeerClients(own_config(tmp_path, etcd, instance("x", "conductor")), instance_of("x"))
        try:
            reply = await peers.for_instance(view.instance_config("p1")).call(
                SWITCH, SwitchRequest("decode", "test", 10.0), timeout_s=20.0)
            assert reply.is_switched and reply.role == "decode"
        finally:
            await peers.close()
        await f.remove("d0")
        await wait_until(lambda: "d0" not in view.decode and "p1" in view.decode and view.decode["p1"].is_placeable,
                         10.0, "p1 the only decode instance")
        body = {"model": "tiny", "prompt": tokens, "max_tokens": NEW_TOKENS, **GREEDY}
        async with http.post(f"http://127.0.0.1:{f.ports['c0']}/v1/completions", json=body) as response:
            answer = await response.json()
            assert response.status == 200, answer
        assert answer["choices"][0]["text"] == text
        assert worker.worker.loaded is not None and worker.worker.loaded.args.mla is not None
