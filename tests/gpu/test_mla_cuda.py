"""Multi-head Latent Attention on CUDA: DeepSeek-V3's attention shape (128 heads over a 576-wide latent, keys and
values one page) through the torch backend the runner picks for MLA, against the same computation on the CPU; and
the tiny MLA model's logits on the device against the CPU's."""

from __future__ import annotations

import pytest
import torch

from mooncaked import kernels
from mooncaked.engine.batch import DecodeSeq, PrefillSeq, build_decode_batch, build_prefill_batch
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.page_allocator import PageAllocator
from mooncaked.engine.runner import ModelRunner
from mooncaked.model.loader import load_model

pytestmark = pytest.mark.gpu

HEADS, WIDTH, LATENT, BLOCK = 128, 576, 512, 64


def test_deepseek_shaped_latent_decode_on_cuda_equals_the_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    num_seqs, context = 4, 700
    num_pages = num_seqs * (context // BLOCK + 1)
    pages = (torch.randn(num_pages, BLOCK, 1, WIDTH, generator=gen) * 0.5).bfloat16()
    tables = torch.arange(num_pages, dtype=torch.int32).view(num_seqs, -1)
    lens = torch.full((num_seqs,), context, dtype=torch.int32)
    q = torch.randn(num_seqs, HEADS, WIDTH, generator=gen).bfloat16()
    scale = 192 ** -0.5
    on_cpu = kernels.decode_attention(q.float(), pages.float(), pages.float(), tables, lens, scale, "torch")
    on_cuda = kernels.decode_attention(q.cuda(), pages.cuda(), pages.cuda(), tables.cuda(), lens.cuda(), scale, "torch")
    torch.testing.assert_close(on_cuda.float().cpu()[..., :LATENT], on_cpu[..., :LATENT], atol=3e-2, rtol=3e-2)


def test_tiny_mla_model_on_cuda_equals_the_cpu() -> None:
    logits = []
    for device in ("cpu", "cuda"):
        loaded = load_model("random:tiny-mla", dtype="float32", device=device)
        kv = KVPages.for_model(loaded.args, num_pages=4, block_size=16, dtype=torch.float32, device=device)
        runner = ModelRunner(loaded.model, kv)  # auto: the torch attention path for MLA on CUDA too
        assert runner.backend == "torch"
        pages = PageAllocator(4).allocate(3, "seq")
        prompt = [3 + (7 * i) % 250 for i in range(37)]
        first = runner.prefill(build_prefill_batch([PrefillSeq(prompt, 0, pages)], block_size=16, num_pages=4,
                                                   device=device))
        step = runner.decode(build_decode_batch([DecodeSeq(int(first[-1].argmax()), 37, pages)], block_size=16,
                                                num_pages=4, device=device))
        logits.append(torch.cat([first, step]).cpu())
    torch.testing.assert_close(logits[1], logits[0], atol=1e-3, rtol=0)
