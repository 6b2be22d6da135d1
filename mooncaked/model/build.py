"""A model with its weights in place: in this process's memory, or on the host's shared weight file.

1. `WeightSource`: a checkpoint's tensors (a fresh iterator per call) and the files they come from.
2. `build_model(args, weights, dtype, device, cache_dir, layers)` (a pipeline stage: only `layers`): with a
   cache directory and source files, the weights are read-only views of the host's weight file for this source
   and layout (model.weight_file), converted into it when new; where that fails (an unwritable or full disk) the
   reason is logged and the weights are allocated in private memory, as they are without a cache directory (and
   always on a GPU). With a ShardShape (a tensor-parallel rank) only the shard's heads and MLP columns are
   allocated, and read as slices where the source can (safetensors).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from mooncaked.model.config import LayerRange, ModelArgs, ShardShape
from mooncaked.model.llama import LlamaForCausalLM
from mooncaked.model.tensor_parallel import Slice
from mooncaked.model.weight_file import WeightLayout, cache_key, open_weight_file

logger = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, torch.Tensor]]
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class WeightSource:
    """What `build_model` needs to read a model's weights: its checkpoint tensors (a fresh iterator per call) and
    the files they come from (empty for generated weights, which are never written to a weight file)."""

    label: str
    model_id: str
    tensors: Callable[[], NamedTensors]
    files: tuple[Path, ...] = ()
    # the tensors with those the mapping names read as their (dim, start, length) slices; None: whole only
    sliced_tensors: Callable[[Mapping[str, Slice]], NamedTensors] | None = None


def build_model(args: ModelArgs, weights: WeightSource, dtype: torch.dtype, device: str,
                cache_dir: str | None, layers: LayerRange | None = None,
                shape: ShardShape | None = None) -> LlamaForCausalLM:
    if cache_dir is not None and weights.files:
        try:
            return _build_mapped(args, weights, dtype, device, Path(cache_dir), layers, shape)
        except OSError as exc:  # WeightFileError, or the directory cannot be created or written
            logger.warning("cannot share the weights of %s through %s (%s); holding them in this process's "
                           "private memory", weights.label, cache_dir, exc)
    model = LlamaForCausalLM(args, dtype=dtype, device=device, layers=layers, shape=shape)
    _load(model, weights)
    return model.eval()


def _load(model: LlamaForCausalLM, weights: WeightSource) -> None:
    """Stream the checkpoint into `model`; a tensor-parallel shard reads only its slices where it can."""
    slices = model.weight_slices()
    if slices and weights.sliced_tensors is not None:
        model.load_weights(weights.sliced_tensors(slices), source=weights.label, is_sliced=True)
    else:
        model.load_weights(weights.tensors(), source=weights.label)


def _build_mapped(args: ModelArgs, weights: WeightSource, dtype: torch.dtype, device: str,
                  cache_dir: Path, layers: LayerRange | None, shape: ShardShape | None) -> LlamaForCausalLM:
    """The model on read-only views of this host's weight file for `weights` (converted into it if new; a
    tensor-parallel rank's shard has a file of its own)."""
    model = LlamaForCausalLM(args, dtype=dtype, device=device, layers=layers, shape=shape,
                             is_weights_deferred=True)
    layout = WeightLayout.of(model.weight_layout(), dtype)
    shard_tag = "" if model.shape.num_ranks == 1 else f"tp{model.shape.rank}of{model.shape.num_ranks}"
    key = cache_key(weights.files, layout, shard_tag)
    path = cache_dir / f"{_SAFE_NAME.sub('_', weights.model_id)}{shard_tag and '-' + shard_tag}-{key[:16]}.weights"

    def fill(views: dict[str, torch.Tensor]) -> None:
        logger.info("converting %s into the weight file %s (once per host)", weights.label, path)
        model.bind_weights(views)
        _load(model, weights)

    model.bind_weights(open_weight_file(path, key, layout, fill))
    return model.eval()
