"""The building blocks of the decoder layers: RMSNorm and the projection (Linear, optionally MKL-packed).

1. `RMSNorm(dim, eps)`: torch's fused rms_norm over the last dimension.
2. `Linear(in, out, bias)` stores its weight transposed, [in, out] (MKL runs x @ W for a few rows faster than
   x @ W.T); `pack_for_cpu()` adds (or, replacing, puts in its place) an MKL-packed copy for decode-sized
   products (model.packed_gemm); `forward_add` fuses the residual add into the GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mooncaked.model import packed_gemm
from mooncaked.model.packed_gemm import PACKED_MAX_ROWS, PackedWeight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.shape = (dim,)
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.shape, self.weight, self.eps)


class Linear(nn.Module):
    """Projection with the weight stored transposed: weight_t [in_features, out_features], optional bias [out].

    After `pack_for_cpu()` succeeds, products of at most PACKED_MAX_ROWS rows read an MKL-packed copy instead;
    after `pack_for_cpu(is_replacing=True)` every product does and the plain weight is gone (weight_t is None).
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device | str,
                 bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight_t: nn.Parameter | None = nn.Parameter(
            torch.empty(in_features, out_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None
        self.packed: PackedWeight | None = None

    def pack_for_cpu(self, is_replacing: bool = False) -> bool:
        """Build the packed copy of the current weight (call again after changing it); False if unavailable.
        With `is_replacing`, the packed copy serves every row count and the plain weight is dropped."""
        if self.weight_t is None:
            raise RuntimeError("this projection's plain weight was replaced by its packed copy; reload the model")
        self.packed = packed_gemm.pack(self.weight_t, is_every_row_count=is_replacing)
        if self.packed is None or not is_replacing:
            return self.packed is not None
        self.packed = packed_gemm.without_plain(self.packed)
        self.weight_t = None
        return True

    def _reads_packed(self, num_rows: int) -> bool:
        return self.packed is not None and (self.weight_t is None or num_rows <= PACKED_MAX_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        if self._reads_packed(x.shape[0]):
            assert self.packed is not None
            return packed_gemm.matmul(x, self.packed, self.bias)
        assert self.weight_t is not None
        if self.bias is not None:
            return torch.addmm(self.bias, x, self.weight_t)
        return torch.matmul(x, self.weight_t)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ W (+ bias) for 2-D x [T, in] and residual [T, out] (one GEMM, no add pass, when unpacked
        and bias-free)."""
        if self._reads_packed(x.shape[0]):
            assert self.packed is not None
            return packed_gemm.matmul(x, self.packed, self.bias).add_(residual)
        assert self.weight_t is not None
        out = torch.addmm(residual, x, self.weight_t)
        return out if self.bias is None else out.add_(self.bias)
