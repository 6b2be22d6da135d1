"""The layer-wise model runner: one forward over paged KV, with a hook before and after every layer.

1. `ModelRunner(model, kv_pages, backend)`: the model's weights and the pages are owned elsewhere; the runner
   owns nothing mutable, so a role can switch between prefill and decode work with the same runner.
2. `prefill(batch)` runs one chunk of new tokens per sequence (each after its cached prefix) and returns the
   last new token's logits per sequence (all rows with `return_all_logits`). `decode(batch)` runs one new
   token per sequence and returns logits [S, vocab]; with `cuda_graphs` (CUDA, Triton) a step without layer
   callbacks replays the CUDA graph of its batch-size bucket (engine/cuda_graphs.py) instead.
3. For every layer i (of the layers this model holds: a pipeline stage holds a range of them, and takes the
   previous stage's hidden states instead of embedding tokens): `before_layer(i)` (the caller waits there until layer
   i's prefix KV is in the pages), then the layer: store the new tokens' K/V into pages, attend over the pages (within
   the layer's sliding window, if the model has one: every token's KV is still stored, so prefixes stay shareable),
   MLP; then `after_layer(i)`. Over compressed pages (kv.cache_dtype int8, fp8_e4m3) the query, keys and values
   are rotated before the attention step and its output rotated back (kernels/quantized_kv.rotation)
   (the caller starts storing layer i's new KV). A callback that raises aborts the forward: the exception
   propagates, the runner has changed nothing but KV slots of this batch's own pages, and the allocator is
   untouched, so the caller frees or reuses the pages as usual.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mooncaked import kernels
from mooncaked.engine.batch import DecodeBatch, PrefillBatch
from mooncaked.engine.cuda_graphs import DecodeGraphs
from mooncaked.engine.kv_pages import KVPages
from mooncaked.kernels.quantized_kv import rotate, rotation
from mooncaked.model.llama import LlamaForCausalLM
from mooncaked.model.mla import AttendFn

LayerCallback = Callable[[int], None]


class ModelRunner:
    """Executor of forwards over `kv_pages` (owned by the worker) with `model` (shared, read-only); its only
    state is the decode graphs (their static inputs are rewritten every step)."""

    def __init__(self, model: LlamaForCausalLM, kv_pages: KVPages, backend: str = "auto", *,
                 cuda_graphs: bool = False, max_batch_size: int = 32, max_seq_len: int = 2048) -> None:
        args, layers = model.args, model.layer_range
        if (kv_pages.num_layers, kv_pages.first_layer, kv_pages.num_kv_heads, kv_pages.head_dim,
                kv_pages.num_planes) != (layers.size, layers.start, model.shape.num_kv_heads, args.kv_head_dim,
                                         args.num_kv_planes):
            raise ValueError("KV pages do not match the model (layers, this shard's num_kv_heads, head_dim)")
        if kv_pages.device != model.device:
            raise ValueError(f"KV pages on {kv_pages.device} but model on {model.device}")
        kernels.resolve_backend(backend, kv_pages.buffer)  # validates the name
        if kv_pages.cache_dtype != "auto" and cuda_graphs:
            # both kernel backends quantize on store and dequantize on read (kernels/quantized_kv.py,
            # kernels/triton_packed.py); replaying a captured step over packed pages is not checked on a GPU yet
            raise ValueError(f"{kv_pages.cache_dtype} KV pages run without CUDA graphs; set model.cuda_graphs: false")
        if args.mla is not None and backend == "auto":
            # Triton's attention tiles a query-head group by a whole KV head's width: DeepSeek-V3's 128 heads over a
            # 576-wide latent ask 768 KiB of shared memory (an H200 has 227 KiB); the torch path runs SDPA there
            backend = "torch"
        self.model = model
        self.kv_pages = kv_pages
        self.backend = backend
        self.scale = args.attention_scale
        self.first_layer = layers.start  # page layer of model layer i: i - first_layer
        self.layer_windows = [args.layer_sliding_window(i) for i in range(args.num_layers)]
        # [D, D]: packed rows hold rotated K/V, which shrinks int8's rounding step (kernels/quantized_kv.py)
        self.rotation = None if kv_pages.cache_dtype == "auto" else rotation(kv_pages.head_dim, kv_pages.device)
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs:
            if kv_pages.device.type != "cuda" or kernels.resolve_backend(backend, kv_pages.buffer) != "triton":
                raise ValueError("cuda_graphs needs the model on CUDA with the Triton kernel backend")
            max_blocks = -(-max_seq_len // kv_pages.block_size)
            self.graphs = DecodeGraphs(self._decode_eager, kv_pages.device, max_batch_size, max_blocks)

    def prefill(self, batch: PrefillBatch, *, before_layer: LayerCallback | None = None,
                after_layer: LayerCallback | None = None, return_all_logits: bool = False,
                hidden_in: torch.Tensor | None = None, return_hidden: bool = False) -> torch.Tensor:
        """One chunk -> logits fp32 [S, vocab] (last new token per sequence), or [T, vocab] if return_all_logits.

        A pipeline stage after the first takes the previous stage's output `hidden_in` [T, hidden] in place of
        embedding batch.input_ids; with `return_hidden` (every stage but the last) the result is hidden
        [T, hidden] after this stage's last layer instead of logits."""
        k_pages, v_pages = self.kv_pages.k_pages, self.kv_pages.v_pages
        backend, scale, windows, first = self.backend, self.scale, self.layer_windows, self.first_layer

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            page_layer = layer - first
            kernels.store_kv(k, v, k_pages[page_layer], v_pages[page_layer], batch.slot_mapping, backend)
            return kernels.prefill_attention(q, k_pages[page_layer], v_pages[page_layer], batch.block_tables,
                                             batch.cu_seqlens_q, batch.seq_lens, scale, backend,
                                             sliding_window=windows[layer])

        with torch.inference_mode():
            hidden = self._layers(batch.input_ids, batch.positions, _in_rotated_space(attend, self.rotation),
                                  before_layer, after_layer, hidden_in)
            if return_hidden:
                return hidden
            if not return_all_logits:
                hidden = hidden.index_select(0, batch.last_token_indices)
            return self.model.compute_logits(hidden)

    def decode(self, batch: DecodeBatch, *, before_layer: LayerCallback | None = None,
               after_layer: LayerCallback | None = None, return_hidden: bool = False) -> torch.Tensor:
        """One new token per sequence -> logits fp32 [S, vocab] (hidden [S, hidden] before the final norm with
        `return_hidden`: a tensor-parallel rank other than 0 needs no logits)."""
        if self.graphs is not None and before_layer is None and after_layer is None and not return_hidden:
            with torch.inference_mode():
                return self.graphs.run(batch)
        return self._decode_eager(batch, before_layer, after_layer, return_hidden)

    def _decode_eager(self, batch: DecodeBatch, before_layer: LayerCallback | None = None,
                      after_layer: LayerCallback | None = None, return_hidden: bool = False) -> torch.Tensor:
        k_pages, v_pages = self.kv_pages.k_pages, self.kv_pages.v_pages
        backend, scale, windows = self.backend, self.scale, self.layer_windows
        assert self.first_layer == 0 and self.model.layer_range.is_whole, "decode needs the whole model"
        # one plan per distinct window (a Qwen model may mix windowed and full layers), shared by its layers
        plans = {window: kernels.plan_decode_attention(batch.block_tables, batch.seq_lens, self.kv_pages.block_size,
                                                       self.model.dtype, backend, sliding_window=window)
                 for window in set(windows)}

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kernels.store_kv(k, v, k_pages[layer], v_pages[layer], batch.slot_mapping, backend)
            window = windows[layer]
            return kernels.decode_attention(q, k_pages[layer], v_pages[layer], batch.block_tables,
                                            batch.seq_lens, scale, backend, plans[window], sliding_window=window)

        with torch.inference_mode():
            hidden = self._layers(batch.input_ids, batch.positions, _in_rotated_space(attend, self.rotation),
                                  before_layer, after_layer)
            return hidden if return_hidden else self.model.compute_logits(hidden)

    def _layers(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                before_layer: LayerCallback | None, after_layer: LayerCallback | None,
                hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] (or a previous stage's hidden_in [T, hidden_size]) -> hidden [T, hidden_size] after this
        model's last layer (before the final norm). The callbacks get page layers (0 .. layers held - 1)."""
        model = self.model
        hidden = model.embed(input_ids) if hidden_in is None else hidden_in
        cos, sin = model.rope.lookup(positions)
        for i, layer in enumerate(model.layers):
            if before_layer is not None:
                before_layer(i)
            hidden = layer(hidden, cos, sin, attend)
            if after_layer is not None:
                after_layer(i)
        return hidden


def _in_rotated_space(attend: AttendFn, matrix: torch.Tensor | None) -> AttendFn:
    """`attend` over pages of rotated rows: q, k, v rotated by matrix [D, D] before it, its output rotated back
    (attention commutes with an orthogonal rotation: q.k = (qR).(kR)). No matrix: `attend` itself."""
    if matrix is None:
        return attend
    back = matrix.T  # R^-1 (a view: matmul reads it transposed)

    def rotated(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_rotated = rotate(k, matrix)
        v_rotated = k_rotated if v is k else rotate(v, matrix)  # an MLA latent is its own value
        return rotate(attend(layer, rotate(q, matrix), k_rotated, v_rotated), back)

    return rotated
