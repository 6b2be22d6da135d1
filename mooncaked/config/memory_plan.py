"""What each process of a configuration is expected to hold resident, before any starts (`mooncaked check-config`).

1. `plan_memory(config, args)` (args: the model's hyperparameters, read from its header alone) gives one
   ProcessMemory per instance: its runtime (interpreter, torch, libraries, tokenizer: constants measured with
   `mooncaked bench memory`), the weights it keeps, split into private bytes and pages of the host's shared
   weight file (model.weight_file), its KV pages (sized by engine.kv_budget, exactly as the worker will), an
   activation workspace, and the store's DRAM pool. A budget too small for one request raises KVBudgetTooSmall.
   A worker instance with N tensor-parallel ranks is N processes: N runtimes and workspaces, every rank's
   weight slices (private: ranks map no weight file), and the instance's KV pages (spread over the ranks). A
   prefill group member counts its stage's layers only (weights and KV pages), as its worker loads them.
2. `render(plans)` prints them as YAML comments (check-config's output stays valid YAML), with per-host totals
   that count the shared weight file once.

`worker_packing(role, is_switchable)` is the one rule for which projection copies a worker keeps; the worker
and the plan both use it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from mooncaked.config import Config, InstanceConfig
from mooncaked.config.prefill_groups import group_stage
from mooncaked.engine.kv_budget import DEFAULT_MEMORY_FRACTION, GIB, KVBudget, KVSizing, size_kv
from mooncaked.model.config import LayerRange, ModelArgs
from mooncaked.model.memory_fit import activation_bytes, projection_bytes, weight_bytes
from mooncaked.model.packed_gemm import Packing
from mooncaked.model.tensor_parallel import rank_kv_args

# Resident bytes of a role's process besides its weights, KV pages and pool: the interpreter, torch's and the
# other libraries' pages, the tokenizer, buffers. Measured with `mooncaked bench memory` (torch 2.13 CPU, the
# embedded SmolLM2) after the first requests; see docs/benchmarks.md.
RUNTIME_BYTES = {"conductor": 340 << 20, "store": 70 << 20, "prefill": 420 << 20, "decode": 420 << 20}


def worker_packing(role: str, is_switchable: bool) -> Packing:
    """Which copies of its projections a CPU fp32 worker keeps (model.packed_gemm): a prefill instance's
    prompt-sized products gain nothing from packing; a decode instance's packed copies replace the plain ones;
    a switchable instance may serve either role, so it keeps both."""
    if is_switchable:
        return "both"
    return "plain" if role == "prefill" else "packed"


@dataclass(frozen=True)
class ProcessMemory:
    instance: str
    role: str
    host: str
    runtime: int
    private_weights: int = 0  # packed copies, RoPE tables, or every weight when nothing is shared
    shared_weights: tuple[tuple[str, int], ...] = ()  # (section of the host's weight file, bytes) it maps
    kv: KVSizing | None = None
    workspace: int = 0
    pool: int = 0
    device_note: str = ""  # what lives on a GPU instead

    @property
    def total(self) -> int:
        kv = self.kv.nbytes if self.kv is not None and not self.device_note else 0
        return (self.runtime + self.private_weights + sum(n for _, n in self.shared_weights) + kv + self.workspace
                + self.pool)


def plan_memory(config: Config, args: ModelArgs) -> list[ProcessMemory]:
    return [_plan_instance(config, args, instance) for instance in config.cluster.instances]


def _plan_instance(config: Config, args: ModelArgs, instance: InstanceConfig) -> ProcessMemory:
    runtime = RUNTIME_BYTES[instance.role]
    if instance.role == "store":
        return ProcessMemory(instance.name, "store", instance.host, runtime, pool=config.store.dram_bytes)
    if instance.role == "conductor":
        return ProcessMemory(instance.name, "conductor", instance.host, runtime)
    return _plan_worker(config, args, instance, runtime)


def _plan_worker(config: Config, args: ModelArgs, instance: InstanceConfig, runtime: int) -> ProcessMemory:
    section, model = config.role_section(instance), config.model
    device = torch.device(model.device)
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[model.dtype]
    budget = KVBudget(section.num_kv_pages, section.kv_memory_bytes, section.memory_fraction)
    name, role, host = instance.name, instance.role, instance.host
    layers = stage_layers(config, instance, args)
    if device.type == "cuda":
        num_gpus = config.tensor_parallel_size_of(instance)
        return ProcessMemory(name, role, host, num_gpus * runtime,
                             device_note=_gpu_note(config, args, budget, dtype, num_gpus, layers))
    kv = size_kv(budget, args=args, block_size=config.kv.block_size, dtype=dtype, device_type=device.type,
                 max_model_len=model.max_model_len, num_layers=None if layers is None else layers.size,
                 cache_dtype=config.kv.cache_dtype)
    workspace = activation_bytes(args, section.max_batch_tokens, section.max_batch_size, dtype)
    is_packable = model.cpu_packed_gemm and dtype == torch.float32
    packing = worker_packing(role, section.switchable) if is_packable else "plain"
    num_ranks = config.tensor_parallel_size_of(instance)
    if num_ranks > 1:  # N processes, each a runtime, its weight slices (none shared) and a workspace
        weights = num_ranks * weight_bytes(args, dtype, packing, layers, num_ranks=num_ranks) \
            + fp32_head_bytes(args, dtype, layers)  # the ranks' vocabulary slices of it
        return ProcessMemory(name, role, host, num_ranks * runtime, weights, (), kv, num_ranks * workspace)
    projections = projection_bytes(args, dtype, layers)
    held = weight_bytes(args, dtype, layers=layers)  # every plain weight (of the stage) and the RoPE tables
    rope = 2 * args.context_length * args.rope_head_dim * dtype.itemsize
    resident = held - rope - projections
    if not model.share_weights:
        private = held + (projections if packing == "both" else 0) + fp32_head_bytes(args, dtype, layers)
        return ProcessMemory(name, role, host, runtime, private, (), kv, workspace)
    shared = [("resident", resident)] + ([] if packing == "packed" else [("projections", projections)])
    private = rope + (0 if packing == "plain" else projections) + fp32_head_bytes(args, dtype, layers)
    return ProcessMemory(name, role, host, runtime, private, tuple(shared), kv, workspace)


def fp32_head_bytes(args: ModelArgs, dtype: torch.dtype, layers: LayerRange | None) -> int:
    """A bf16/fp16 model on CPU keeps its output head in fp32 too (LlamaForCausalLM.keep_fp32_head)."""
    if dtype == torch.float32 or (layers is not None and not layers.has_head):
        return 0
    return args.hidden_size * args.vocab_size * 4


def stage_layers(config: Config, instance: InstanceConfig, args: ModelArgs) -> LayerRange | None:
    """The layers a prefill group member holds (its stage of the group's split), None for any other instance."""
    stage = group_stage(config, instance, args.num_layers)
    return None if stage is None else stage.layers


def _gpu_note(config: Config, args: ModelArgs, budget: KVBudget, dtype: torch.dtype, num_ranks: int,
              layers: LayerRange | None) -> str:
    """On CUDA, per GPU: with N ranks each GPU holds a rank's weights (of the stage's layers in a prefill group)
    and the pages of its KV heads."""
    where = "on the GPU" if num_ranks == 1 else f"on each of {num_ranks} GPUs"
    weights = f"{where}: {weight_bytes(args, dtype, layers=layers, num_ranks=num_ranks) / GIB:.2f} GiB of weights"
    if budget.num_kv_pages is None and budget.kv_memory_bytes is None:
        fraction = DEFAULT_MEMORY_FRACTION if budget.memory_fraction is None else budget.memory_fraction
        return f"{weights}; KV pages: {fraction:g} of the GPU memory free at start, less weights and workspace"
    kv = size_kv(budget, args=rank_kv_args(args, num_ranks), block_size=config.kv.block_size, dtype=dtype,
                 device_type="cuda", max_model_len=config.model.max_model_len,
                 num_layers=None if layers is None else layers.size, cache_dtype=config.kv.cache_dtype)
    return f"{weights}; {kv.describe()}"


def render(plans: list[ProcessMemory]) -> list[str]:
    """YAML comment lines: one per process, then one per host."""
    lines = ["# expected resident memory per process, GiB (estimates; `mooncaked bench memory` measures them):",
             f"#   {'instance':<14} {'role':<9} {'runtime':>7} {'weights':>7} {'shared':>7} {'kv':>6} "
             f"{'work':>6} {'pool':>6} {'total':>6}  kv pages"]
    for p in plans:
        shared = sum(n for _, n in p.shared_weights)
        kv_text = p.device_note or (p.kv.describe().removeprefix("KV cache: ") if p.kv is not None else "-")
        kv_bytes = p.kv.nbytes if p.kv is not None and not p.device_note else 0
        lines.append(f"#   {p.instance:<14} {p.role:<9} {_g(p.runtime):>7} {_g(p.private_weights):>7} "
                     f"{_g(shared):>7} {_g(kv_bytes):>6} {_g(p.workspace):>6} {_g(p.pool):>6} {_g(p.total):>6}  "
                     f"{kv_text}")
    lines.append("#   (shared: pages of the host's weight file, counted in each process that maps them)")
    for host, (total, once) in _host_totals(plans).items():
        lines.append(f"# host {host}: {total / GIB:.2f} GiB in all processes, {once / GIB:.2f} GiB with the "
                     "shared weight file counted once")
    return lines


def _host_totals(plans: list[ProcessMemory]) -> dict[str, tuple[int, int]]:
    totals: dict[str, int] = defaultdict(int)
    sections: dict[str, dict[str, int]] = defaultdict(dict)
    for p in plans:
        totals[p.host] += p.total
        for section, nbytes in p.shared_weights:
            sections[p.host][section] = nbytes
    result = {}
    for host, total in totals.items():
        counted = sum(n for p in plans if p.host == host for _, n in p.shared_weights)
        result[host] = (total, total - counted + sum(sections[host].values()))
    return result


def _g(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f}" if num_bytes else "-"
