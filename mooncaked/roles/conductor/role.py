"""The conductor role: the OpenAI-compatible HTTP API in front of the cluster (docs/design.md sections 3, 7 and 9).

1. `start()`: load the tokenizer, chat template and model shape (no weights), build the scheduler's policy and
   default predictors, start the cluster view (index resync from every store's dump, first LOAD round), the
   context-cache registry (caches.py) and, with `conductor.batch_dir`, the batch manager (batches.py: it resumes
   unfinished batches), then serve HTTP on `instance.host:instance.port` and, when `instance.rpc_port` is set,
   the health/info RPC endpoint.
2. Requests flow through `ConductorBackend` (see backend.py); /v1/caches through the cache registry, /v1/files
   and /v1/batches through the batch manager.
3. `stop()`: stop accepting HTTP, let in-flight requests finish up to runtime.drain_timeout_s, cancel the rest
   (their legs are cancelled remotely), then stop the RPC endpoint, the batch manager (running lines cancelled,
   not answered), the cache registry, the store followers and LOAD pollers, and close the RPC clients, in that
   order.

Owns the HTTP runner, the RPC endpoint, the peer clients, the metrics, the cluster view, the backend, the cache
registry and the batch manager. Besides the Batch API's files and journals under `conductor.batch_dir`, it holds
no state that the stores and workers cannot give back: a restarted conductor serves correctly at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import Iterable, Sequence
from pathlib import Path

from aiohttp import web

from mooncaked.api.app import create_app
from mooncaked.api.batch_routes import add_batch_routes, add_disabled_routes
from mooncaked.api.cache_routes import add_cache_routes
from mooncaked.api.client_guard import ClientGuard, GuardedSite
from mooncaked.api.tenant_gate import TenantGate
from mooncaked.cluster.etcd_membership import EtcdMembership
from mooncaked.cluster.membership import Membership, StaticMembership
from mooncaked.config import Config, ConfigError, InstanceConfig
from mooncaked.config.schema import ConfigIssue
from mooncaked.kv.cache_dtype import row_bytes
from mooncaked.model.frontend import ModelFrontendInfo, load_frontend
from mooncaked.model.grammar import GrammarTokenizer
from mooncaked.model.loader import resolve_dtype
from mooncaked.model.reasoning import reasoning_format_for
from mooncaked.model.tokenizer import TextTokenizer
from mooncaked.model.tool_formats import tool_format_for
from mooncaked.model.weight_names import num_active_parameters
from mooncaked.roles.base import PeerClients, RoleEndpoint
from mooncaked.roles.conductor.backend import ConductorBackend
from mooncaked.roles.conductor.batch.batches import BatchManager
from mooncaked.roles.conductor.caches import CacheRegistry
from mooncaked.roles.conductor.completion import complete
from mooncaked.roles.conductor.frontend import ModelFrontend
from mooncaked.roles.conductor.leader import PdController
from mooncaked.roles.conductor.tenancy import make_gate
from mooncaked.roles.conductor.tenancy import reload as reload_tenants
from mooncaked.roles.conductor.view.cluster import ClusterView, ClusterViewSettings
from mooncaked.roles.conductor.view.predictors import LivePredictors
from mooncaked.roles.conductor.view.store_follower import FollowerSettings
from mooncaked.runtime.metrics import Metrics
from mooncaked.sched.predictors import DecodeStepPredictor, Predictors, PrefillTimePredictor, TransferTimePredictor
from mooncaked.sched.types import PolicyConfig

logger = logging.getLogger(__name__)

# Throughput assumed, when scheduler.device_flops / device_memory_bandwidth are not set, before measurements
# replace the predictors: dense FLOP/s and memory bytes/s of a recent datacenter GPU and of a few CPU cores.
DEFAULT_FLOPS = {"cuda": 3e14, "cpu": 1e11}
DEFAULT_MEMORY_BANDWIDTH = {"cuda": 2e12, "cpu": 2e10}


class ConductorRole:
    """See the module docstring."""

    name = "conductor"

    def __init__(self, config: Config, instance: InstanceConfig, membership: Membership | None = None) -> None:
        self.config = config
        self.instance = instance
        self.membership = membership or StaticMembership(config, instance)  # borrowed: started by its owner
        self.name = f"conductor {instance.name}"
        self.metrics = Metrics()
        self.peers = PeerClients(config, instance)
        self.view: ClusterView | None = None
        self.backend: ConductorBackend | None = None
        self.runner: web.AppRunner | None = None
        self.endpoint: RoleEndpoint | None = None
        self.controller: PdController | None = None
        self.gate: TenantGate | None = None
        self.caches: CacheRegistry | None = None
        self.batches: BatchManager | None = None
        self.bound_port = 0
        self._is_watching_sighup = False

    async def start(self) -> None:
        config = self.config
        model = config.model
        loaded = await asyncio.to_thread(load_frontend, model.source)
        frontend = await asyncio.to_thread(model_frontend, config, loaded)  # the grammar tokenizer takes ~0.4 s
        predictors = LivePredictors(default_predictors(config, loaded))
        self.view = ClusterView(config, self.peers, policy_config(config), predictors, view_settings(config),
                                self.membership)
        await self.view.start()
        if isinstance(self.membership, EtcdMembership):
            self.controller = PdController(config, self.view, self.peers, self.membership)
            await self.controller.start()
        self.backend = ConductorBackend(config, frontend, self.view, self.peers, self.metrics, self.controller)
        backend, section = self.backend, config.conductor
        self.caches = CacheRegistry(config, frontend, self.view, self.peers, backend.namespace,
                                    lambda request: complete(backend, request, section.request_timeout_s))
        await self.caches.start()
        self.gate = make_gate(config, self.metrics)
        guard = ClientGuard(client_timeout_s=section.client_timeout_s,
                            max_connections_per_client=section.max_connections_per_client)
        app = create_app(self.backend, gate=self.gate, max_body_bytes=section.max_body_bytes,
                         request_timeout_s=section.request_timeout_s, client_guard=guard)
        self._watch_sighup()
        add_cache_routes(app, self.caches, list(frontend.served_names), default_ttl_s=section.default_cache_ttl_s,
                         max_ttl_s=section.max_cache_ttl_s)
        if section.batch_dir is None:
            add_disabled_routes(app)
        else:
            gate = self.gate
            self.batches = BatchManager(config, backend, self.view, Path(section.batch_dir),
                                        tenant_of=lambda tenant_id: gate.directory.tenants.get(tenant_id))
            backend.on_interactive_rejection = self.batches.interactive_rejected
            await self.batches.start()
            add_batch_routes(app, self.batches.files, self.batches, section.max_file_bytes)
        self.runner = web.AppRunner(app, shutdown_timeout=config.runtime.drain_timeout_s, access_log=None)
        await self.runner.setup()
        site = GuardedSite(self.runner, self.instance.host, self.instance.port, guard)
        await site.start()
        self.bound_port = _bound_port(self.runner)
        if self.instance.rpc_port:
            self.endpoint = RoleEndpoint(config, self.instance, port=self.instance.rpc_port,
                                         is_healthy=self._is_healthy)
            await self.endpoint.start()
        logger.info("conductor %s serving %s on http://%s:%d (%d prefill, %d decode, %d stores)", self.instance.name,
                    frontend.served_names[0], self.instance.host, self.bound_port, len(self.view.prefill),
                    len(self.view.decode), len(self.view.followers))

    def reload_tenants(self) -> bool:
        """Re-read the tenants file (SIGHUP): requests in flight are untouched; a bad file changes nothing."""
        return self.gate is not None and reload_tenants(self.gate, self.config)

    def _watch_sighup(self) -> None:
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload_tenants)
            self._is_watching_sighup = True
        except (RuntimeError, ValueError):  # not the main thread (an in-process test): reload_tenants() by hand
            logger.debug("SIGHUP not watched: the event loop is not in the main thread")

    async def stop(self) -> None:
        if self._is_watching_sighup:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._is_watching_sighup = False
        if self.runner is not None:
            await self.runner.cleanup()  # stop listening, drain up to drain_timeout_s, cancel the rest
            self.runner = None
        if self.endpoint is not None:
            await self.endpoint.stop()
            self.endpoint = None
        if self.batches is not None:
            await self.batches.stop()  # running lines are cancelled: a restarted conductor runs them again
        if self.caches is not None:
            await self.caches.stop()
        if self.controller is not None:
            await self.controller.stop()
        if self.view is not None:
            await self.view.stop()
        await self.peers.close()

    def _is_healthy(self) -> bool:
        return self.view is not None and any(w.is_up for w in self.view.decode.values())


def _bound_port(runner: web.AppRunner) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple):
            return int(address[1])
    return 0


def model_frontend(config: Config, loaded: ModelFrontendInfo) -> ModelFrontend:
    names = tuple(dict.fromkeys((config.model.name, loaded.model_id)))
    tool_format = tool_format_for(loaded.chat_template.source)
    marker_ids = single_token_ids(loaded.tokenizer, tool_format.markers)
    reasoning = reasoning_format_for(loaded.chat_template.source)
    reasoning_ids = single_token_ids(loaded.tokenizer, (reasoning.start, reasoning.end) if reasoning else ())
    return ModelFrontend(model_id=loaded.model_id, served_names=names, tokenizer=loaded.tokenizer,
                         chat_template=loaded.chat_template, eos_token_ids=loaded.eos_token_ids,
                         vocab_size=loaded.args.vocab_size,
                         context_length=min(loaded.context_length, config.model.max_model_len),
                         kv_geometry=loaded.args.kv_geometry,
                         grammar_tokenizer=GrammarTokenizer(loaded.tokenizer, loaded.args.vocab_size,
                                                            loaded.eos_token_ids),
                         tool_format=tool_format, tool_marker_ids=marker_ids,
                         are_tool_markers_special=any_special(loaded.tokenizer, marker_ids.values()),
                         reasoning_format=reasoning, reasoning_marker_ids=reasoning_ids,
                         are_reasoning_markers_special=any_special(loaded.tokenizer, reasoning_ids.values()))


def single_token_ids(tokenizer: TextTokenizer, texts: Sequence[str]) -> dict[str, int]:
    """The texts the vocabulary holds as one token each (a grammar names them by id), with their ids."""
    ids = {text: tokenizer.encode(text, add_special_tokens=False) for text in texts}
    return {text: token_ids[0] for text, token_ids in ids.items() if len(token_ids) == 1}


def any_special(tokenizer: TextTokenizer, token_ids: Iterable[int]) -> bool:
    """Whether any of the tokens is special (left out of decoded text unless asked for)."""
    return any(not tokenizer.decode([token_id]) for token_id in token_ids)


def policy_config(config: Config) -> PolicyConfig:
    section = config.scheduler
    return PolicyConfig(scheduler=section.policy, admission=section.admission,
                        kvcache_balancing_threshold=section.kvcache_balancing_threshold,
                        ttft_slo_s=section.ttft_slo_ms / 1000, tbt_slo_s=section.tbt_slo_ms / 1000,
                        block_size=config.kv.block_size, decode_time_s=section.decode_time_s, seed=section.seed,
                        replication=section.replication, heat_half_life_s=section.heat_half_life_s,
                        replica_displaced_reuse=section.replica_displaced_reuse, tie_break=section.tie_break,
                        cpp_min_tokens=section.cpp_min_tokens, max_decode_defer_s=section.max_decode_defer_s)


def view_settings(config: Config) -> ClusterViewSettings:
    conductor = config.conductor
    follower = FollowerSettings(events_renew_s=conductor.events_renew_s, dump_timeout_s=config.rpc.call_timeout_s,
                                min_backoff_s=conductor.load_poll_interval_s)
    return ClusterViewSettings(poll_interval_s=conductor.load_poll_interval_s,
                               poll_timeout_s=conductor.load_poll_timeout_s,
                               startup_timeout_s=conductor.startup_sync_timeout_s, follower=follower,
                               spare_marks_interval_s=conductor.spare_marks_interval_s)


def default_predictors(config: Config, loaded: ModelFrontendInfo) -> Predictors:
    """From the model's shape and an assumed device, or fitted from `scheduler.prefill_profile` when set."""
    args, section = loaded.args, config.scheduler
    device = "cuda" if config.model.device.startswith("cuda") else "cpu"
    itemsize = resolve_dtype(config.model.dtype, config.model.device).itemsize
    weight_bytes = num_active_parameters(loaded.args) * itemsize  # a MoE step reads its chosen experts only
    # an MLA latent is several times smaller than GQA K/V; int8 KV (kv.cache_dtype) a quarter of fp32's
    kv_bytes_per_token = (args.num_layers * args.num_kv_planes * args.num_kv_heads
                          * row_bytes(args.kv_head_dim, itemsize, config.kv.cache_dtype))
    prefill = PrefillTimePredictor.from_model(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                              gpu_flops=section.device_flops or DEFAULT_FLOPS[device])
    decode = DecodeStepPredictor.from_model(weight_bytes=weight_bytes, kv_bytes_per_token=kv_bytes_per_token,
                                            hbm_bandwidth=section.device_memory_bandwidth
                                            or DEFAULT_MEMORY_BANDWIDTH[device])
    if section.prefill_profile:
        prefill, decode = read_profile(Path(section.prefill_profile), prefill, decode)
    transfer = TransferTimePredictor(kv_bytes_per_token * config.kv.block_size, section.link_gbps * 1e9 / 8)
    return Predictors(prefill, decode, transfer)


PROFILE_FORMAT = ('{"prefill": [[prompt tokens, prefix tokens, seconds], ...], '
                  '"decode": [[batch size, context tokens, step seconds], ...]}')


def read_profile(path: Path, prefill: PrefillTimePredictor,
                 decode: DecodeStepPredictor) -> tuple[PrefillTimePredictor, DecodeStepPredictor]:
    """Fit the predictors a profile (JSON in PROFILE_FORMAT; either list may be absent) measures."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not data or set(data) - {"prefill", "decode"}:
            raise ValueError("the top level must be an object with a \"prefill\" and/or a \"decode\" list")
        if "prefill" in data:
            prefill = PrefillTimePredictor.fit([(int(n), int(p), float(s)) for n, p, s in data["prefill"]])
        if "decode" in data:
            decode = DecodeStepPredictor.fit([(int(b), int(t), float(s)) for b, t, s in data["decode"]])
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError([ConfigIssue("scheduler.prefill_profile",
                                       f"{path}: {exc}; expected JSON {PROFILE_FORMAT}")]) from None
    return prefill, decode
