"""The KV cache's storage format (`kv.cache_dtype`): what one token's one KV head takes in pages, store objects
and transfers, and how the format enters the block keys' namespace.

1. `auto`: the model's dtype, head_dim values.
2. `int8`: head_dim int8 values (symmetric, round to nearest) followed by their scale as one bfloat16 (max |x| /
   127 of that token's head): head_dim + 2 bytes. Per token and KV head rather than per block: a decode step
   appends tokens to a block without rescaling the ones before, and the scale costs 2 bytes per 64 to 128
   (fp32's 256 bytes of a 64-wide head become 66: 3.9x; bf16's 128: 1.9x).
3. `fp8_e4m3`: the same layout with e4m3 values (scale max |x| / 448): the same bytes, a relative rather than an
   absolute rounding error per value.
   Both packed formats hold each row after an orthogonal (Hadamard) rotation of its head_dim values, which
   halves int8's error (kernels/quantized_kv.rotation): the rotation is part of the format's namespace text.
4. `namespace_dtype(model_dtype, cache_dtype)`: the dtype text the model namespace folds in (kv/keys.py): a
   compressed cluster's blocks never share keys with an uncompressed one's (`auto` keeps the model's own text,
   so its keys do not change).
Pure: standard library only (the engine's pages, engine/kv_pages.py, and the kernels, kernels/quantized_kv.py,
use it; so do the memory budget, check-config and the conductor's transfer-time estimate).
"""

from __future__ import annotations

CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
PACKED_CACHE_DTYPES = ("int8", "fp8_e4m3")  # head_dim one-byte values and a 2-byte scale a row
INT8_SCALE_BYTES = 2  # one bfloat16 scale per token and KV head


def check_cache_dtype(cache_dtype: str) -> None:
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"kv.cache_dtype must be one of {', '.join(CACHE_DTYPES)}, got {cache_dtype!r}")


def row_width(head_dim: int, cache_dtype: str) -> int:
    """Elements of one token's one KV head in the pages: head_dim values (auto), or head_dim + 2 bytes (packed)."""
    check_cache_dtype(cache_dtype)
    return head_dim + INT8_SCALE_BYTES if cache_dtype in PACKED_CACHE_DTYPES else head_dim


def row_bytes(head_dim: int, itemsize: int, cache_dtype: str) -> int:
    """Bytes of one token's one KV head: head_dim x the model's itemsize (auto), head_dim + 2 (packed)."""
    return row_width(head_dim, cache_dtype) * (1 if cache_dtype in PACKED_CACHE_DTYPES else itemsize)


def namespace_dtype(model_dtype: str, cache_dtype: str) -> str:
    check_cache_dtype(cache_dtype)
    return model_dtype if cache_dtype == "auto" else f"{model_dtype}|kv:{cache_dtype}/token-head/bf16-scale/hadamard"
