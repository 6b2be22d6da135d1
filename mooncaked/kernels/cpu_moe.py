"""Routed experts of a decode step on CPU through a small C kernel (kernels/cpu_moe.c), for fp32 and bf16 models.

1. `load()` (once per process, cached): the shared library is built from cpu_moe.c with the system C compiler
   into kernels/_build/, named by the source's hash and the compiler flags (a changed source gets a new file; a
   build writes a temporary name and renames it, so processes building at once never load a half-written
   file), then loaded with ctypes. `make venv` builds it ahead (`python -m mooncaked.kernels.cpu_moe`). No
   compiler, a failed build or a non-x86-64 host: None, logged once, and the torch paths of model/moe.py run.
2. `is_usable(x, gate_up)`: whether a product may take the kernel: CPU tensors, fp32 or bf16 (activations and
   weights of one dtype; a bf16 model's weights are read as bf16, half the bytes), at most MAX_TOKENS tokens
   (a decode batch: each expert gets a few rows, where MKL's sgemm streams its weight at a third of memory
   speed; prefill chunks stay on torch's GEMMs, which win once an expert has tens of rows), at most MAX_THREADS
   torch threads (the kernel runs on one: measured on this project's 2-core host it beats torch's experts 2-3x
   at 1 and at 2 threads; a process given more cores keeps torch's multithreaded GEMMs, not measured here).
3. `run_experts(...)`: model/moe.run_experts' contract, computed by the kernel into a zeroed fp32 [T, H] tensor
   (activations and the intermediate in fp32), returned in x's dtype.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_moe.c")
BUILD_DIR = Path(__file__).with_name("_build")
COMPILER = "cc"  # Debian's gcc provides it
CFLAGS = ("-O3", "-shared", "-fPIC", "-std=c11")
# measured on hidden 512, 16 experts of 192, top-4 (docs/benchmarks.md): the kernel wins up to ~32 tokens in fp32
# (1.1-1.2x there) and ~24 in bf16 (0.85x at 32); torch's GEMMs from then on
MAX_TOKENS = 24
MAX_THREADS = 2
BUILD_TIMEOUT_S = 120.0
_DTYPES = (torch.float32, torch.bfloat16)  # the weight formats the kernel reads


def library_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return BUILD_DIR / f"cpu_moe-{platform.machine()}-{digest}.so"


def build() -> Path:
    """Compile cpu_moe.c (if this source and flags have no library yet) and return the library's path; raises
    RuntimeError naming the compiler's complaint."""
    path = library_path()
    if path.exists():
        return path
    BUILD_DIR.mkdir(exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        try:
            result = subprocess.run([COMPILER, *CFLAGS, str(SOURCE), "-o", str(partial), "-lm"], capture_output=True,
                                    text=True, timeout=BUILD_TIMEOUT_S, check=False)
        except FileNotFoundError:
            raise RuntimeError(f"no C compiler ({COMPILER}): install gcc to build the CPU MoE kernel") from None
        if result.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed: {result.stderr.strip()[:2000]}")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernel, or None (logged once) where it cannot be built or loaded here."""
    if platform.machine() not in ("x86_64", "AMD64"):
        logger.info("CPU MoE kernel: built for x86-64 only; %s runs torch's experts", platform.machine())
        return None
    try:
        library = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as error:
        logger.warning("CPU MoE kernel unavailable, decode runs torch's experts (slower): %s", error)
        return None
    function = library.moe_experts
    pointer, count = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer, count, count, pointer, pointer, count, pointer, pointer, ctypes.c_int, count, count,
                         count, pointer]
    function.restype = ctypes.c_int
    return library


def is_usable(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in _DTYPES and gate_up.dtype == x.dtype
            and x.shape[0] <= MAX_TOKENS and torch.get_num_threads() <= MAX_THREADS and load() is not None)


def run_experts(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, expert_offset: int) -> torch.Tensor:
    """x [T, H]; weights fp32 [T, K]; expert_ids int64 [T, K]; gate_up [E_local, H, 2I]; down [E_local, I, H],
    fp32 or bf16 -> [T, H] in x's dtype: sum over each token's chosen experts held here of weight * expert(x)."""
    library = load()
    assert library is not None and gate_up.dtype == down.dtype and gate_up.dtype in _DTYPES
    activations = x.to(torch.float32).contiguous()
    weights = weights.to(torch.float32).contiguous()
    expert_ids = expert_ids.to(torch.int64).contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()  # parameters are: no copy
    num_tokens, hidden = activations.shape
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    status = library.moe_experts(activations.data_ptr(), num_tokens, hidden, expert_ids.data_ptr(),
                                 weights.data_ptr(), expert_ids.shape[1], gate_up.data_ptr(), down.data_ptr(),
                                 int(gate_up.dtype == torch.bfloat16), gate_up.shape[0], gate_up.shape[2] // 2,
                                 expert_offset, out.data_ptr())
    if status != 0:
        raise MemoryError(f"CPU MoE kernel: no memory for the scratch of {num_tokens} tokens")
    return out.to(x.dtype)


if __name__ == "__main__":  # `make venv`: build ahead of the first model load
    load()
