"""The KV copy stream on CUDA: a store waits for its layer's compute and nothing later, a load waits for no
compute, the compute after a load sees its bytes; and, from CUDA events, layer i's store copy runs while layer
i+1 computes."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from mooncaked.engine.kv_copy import KVCopier, new_staging
from mooncaked.engine.kv_pages import KVPages

pytestmark = pytest.mark.gpu

SPIN_CYCLES = 50_000_000  # tens of milliseconds of one spinning kernel on any current GPU


def pages() -> KVPages:
    return KVPages(num_layers=3, num_pages=8, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16,
                   device="cuda")


def warm_up(kv: KVPages, copier: KVCopier, staging: torch.Tensor) -> None:
    """One load and one store first: the caching allocators then hold the blocks the timed copies use (a first
    cudaMalloc could order the streams)."""
    page_ids = list(range(staging.shape[0]))
    copier.load_layer(kv, 0, staging, page_ids).synchronize()
    copier.store_layer(kv, 0, staging, page_ids).synchronize()
    torch.cuda.synchronize()


def test_a_store_waits_for_its_layers_compute_and_nothing_later() -> None:
    kv, copier = pages(), KVCopier("cuda")
    staging = new_staging(kv, 2)
    warm_up(kv, copier, staging)
    # indices on the device before the spins: indexing with a host list copies it from pageable memory, which
    # blocks this thread until the compute stream drains
    rows = torch.tensor([2, 5], device="cuda")
    torch.cuda._sleep(SPIN_CYCLES)  # the compute stream is busy...
    kv.k_pages[1].index_fill_(0, rows, 7.0)  # ...before it writes layer 1's pages
    layer_done = copier.mark_compute()  # after_layer(1), on the compute thread
    torch.cuda._sleep(4 * SPIN_CYCLES)  # layer 2 and later: long, and they overwrite the pages
    kv.k_pages[1].index_fill_(0, rows, 9.0)
    with concurrent.futures.ThreadPoolExecutor(1) as copy_thread:  # the worker's copy thread
        copy_thread.submit(lambda: copier.store_layer(kv, 1, staging, [2, 5], layer_done).synchronize()).result()
    assert not torch.cuda.current_stream().query(), "the store waited for compute queued after its layer"
    assert bool((staging[:, 1, 0].float() == 7.0).all())


def test_a_load_waits_for_no_compute_and_compute_after_it_sees_its_bytes() -> None:
    kv, copier = pages(), KVCopier("cuda")
    staging = new_staging(kv, 1)
    warm_up(kv, copier, staging)
    staging.fill_(3.0)
    torch.cuda._sleep(4 * SPIN_CYCLES)  # a long forward of another request on the compute stream
    handle = copier.load_layer(kv, 0, staging, [4])
    handle.synchronize()  # returns while the compute stream still spins: the load did not wait for it
    assert not torch.cuda.current_stream().query()
    handle.wait_on_current_stream()
    total = kv.k_pages[0][4].float().sum()  # queued after the wait: sees the loaded bytes
    assert float(total) == 3.0 * kv.k_pages[0][4].numel()


def test_layer_i_store_copy_overlaps_layer_i_plus_1_compute() -> None:
    kv, copier = pages(), KVCopier("cuda")
    staging = new_staging(kv, 4)
    warm_up(kv, copier, staging)
    compute, copy_stream = torch.cuda.current_stream(), copier.stream_for(kv.device)
    marks: dict[tuple[str, int], torch.cuda.Event] = {}

    def mark(name: str, layer: int, stream: torch.cuda.Stream) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        marks[(name, layer)] = event

    base = torch.cuda.Event(enable_timing=True)
    base.record(compute)
    handles = []
    for layer in range(kv.num_layers):
        mark("compute_start", layer, compute)
        torch.cuda._sleep(SPIN_CYCLES)  # layer `layer`'s compute
        kv.k_pages[layer][:4] = float(layer + 1)
        mark("compute_end", layer, compute)
        handles.append(copier.store_layer(kv, layer, staging, [0, 1, 2, 3]))
        with torch.cuda.stream(copy_stream):
            mark("store_end", layer, copy_stream)
    for handle in handles:
        handle.synchronize()
    torch.cuda.synchronize()

    def at(name: str, layer: int) -> float:
        return base.elapsed_time(marks[(name, layer)])

    for layer in range(kv.num_layers - 1):
        assert at("store_end", layer) < at("compute_end", layer + 1), f"layer {layer}'s store waited for later compute"
        assert at("store_end", layer) >= at("compute_end", layer), "a store ran before its layer's compute"
    assert all(bool((staging[:, layer, 0].float() == layer + 1).all()) for layer in range(kv.num_layers))
