"""The simulator's cost model, derived from the model and GPU sections of the sim config.

1. KV bytes per token = l * 2 * (d / gqa) * s (the paper's Table 1 notation: 320 KiB for LLaMA3-70B), or the
   model's own (`model.kv_bytes_per_token`, from its config: an MLA model caches one latent per token and layer).
2. Prefill time: Eq. 1 on the new tokens at `gpu.flops * gpu.mfu`, plus a fixed overhead; with
   `model.active_parameters` its linear term is 2 FLOPs per active weight and new token (an MoE model computes
   with the experts it routes to only) and its quadratic term takes `model.attention_width` for d.
3. Decode step: read all weights and every running token's KV at `hbm_bandwidth * hbm_utilisation`, plus a fixed
   and a per-request overhead (tensor-parallel all-reduces, sampling).
4. Transfers: bytes / link bandwidth + latency; loading a request's KV into a decode GPU: bytes / B_h2d.
5. A prefill group's stage hands one chunk's hidden states (chunk tokens x d x s bytes) to the next stage over
   the link: `chunk_handoff_s`.
The same predictors serve as the scheduler's predictions and (up to `run.prefill_noise`) as the ground truth.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncaked.sched.predictors import DecodeStepPredictor, Predictors, PrefillTimePredictor, TransferTimePredictor
from mooncaked.sim.config import SimConfig


@dataclass(frozen=True)
class CostModel:
    predictors: Predictors
    kv_bytes_per_token: int
    bytes_per_block: int
    link_bandwidth: float  # bytes/s
    link_latency_s: float
    h2d_bandwidth: float  # bytes/s
    max_decode_context_tokens: int
    chunk_handoff_s: float  # one pipeline chunk's hidden states from a stage to the next


def build_cost_model(config: SimConfig) -> CostModel:
    model, gpu, cluster = config.model, config.gpu, config.cluster
    kv_bytes_per_token = (model.kv_bytes_per_token
                          or model.num_layers * 2 * (model.hidden_size // model.gqa) * model.dtype_bytes)
    flops_a, flops_b = model.flops_a, model.flops_b
    if model.attention_width:
        flops_a = model.flops_a * model.attention_width / model.hidden_size
    if model.active_parameters:
        flops_b = 2 * model.active_parameters / (model.num_layers * model.hidden_size ** 2)
    bytes_per_block = kv_bytes_per_token * config.scheduler.block_size
    link_bandwidth = cluster.link_bandwidth_gbps * 1e9 / 8
    prefill = PrefillTimePredictor.from_model(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        gpu_flops=gpu.flops,
        mfu=gpu.mfu,
        a=flops_a,
        b=flops_b,
        overhead_s=gpu.prefill_overhead_s,
    )
    decode = DecodeStepPredictor.from_model(
        weight_bytes=model.weight_bytes,
        kv_bytes_per_token=kv_bytes_per_token,
        hbm_bandwidth=gpu.hbm_bandwidth,
        bandwidth_utilisation=gpu.hbm_utilisation,
        per_request_s=gpu.decode_per_request_s,
        overhead_s=gpu.decode_overhead_s,
    )
    transfer = TransferTimePredictor(bytes_per_block, link_bandwidth, cluster.link_latency_s)
    chunk_bytes = cluster.cpp_chunk_tokens * model.hidden_size * model.dtype_bytes
    kv_hbm_bytes = max(gpu.hbm_bytes - model.weight_bytes, 0.0) * gpu.kv_memory_fraction
    return CostModel(
        predictors=Predictors(prefill, decode, transfer),
        kv_bytes_per_token=kv_bytes_per_token,
        bytes_per_block=bytes_per_block,
        link_bandwidth=link_bandwidth,
        link_latency_s=cluster.link_latency_s,
        h2d_bandwidth=cluster.h2d_bandwidth_gbps * 1e9 / 8,
        max_decode_context_tokens=int(kv_hbm_bytes // kv_bytes_per_token),
        chunk_handoff_s=cluster.link_latency_s + chunk_bytes / link_bandwidth,
    )
