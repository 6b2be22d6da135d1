"""CUDA graphs for decode steps: one captured graph per batch-size bucket, replayed with each step's inputs.

1. `DecodeGraphs(step, device, max_batch_size, max_blocks)` owns static inputs sized for the largest bucket
   (input_ids, positions, slot_mapping [bucket]; block_tables [bucket, max_blocks]; seq_lens [bucket]) and one
   graph per bucket (1, 2, 4, ... up to max_batch_size), captured on the first step of that size: two eager
   warm-up steps on a side stream (Triton compiles there), then the capture of `step` over the static inputs.
2. `run(batch)` pads the step to its bucket: padding rows write their K/V nowhere (slot -1, which the Triton
   store_kv skips) and attend over one token of page 0 (their output is dropped); it copies the inputs into
   the static buffers, replays, and returns a copy of the first rows of the logits (the next replay
   overwrites the static output).
3. A step larger than the largest bucket, or with a block table wider than `max_blocks`, runs eagerly.
The warm-up and capture run the real step on the real inputs: storing the same K/V in the same slots again
changes nothing. Capture errors are thread-local, so the copy thread may keep using CUDA meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mooncaked.engine.batch import DecodeBatch

DecodeStep = Callable[[DecodeBatch], torch.Tensor]  # batch -> logits fp32 [S, vocab]
NUM_WARMUP_STEPS = 2


def bucket_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... below max_batch_size, then max_batch_size itself."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [1 << i for i in range(max_batch_size.bit_length()) if 1 << i < max_batch_size]
    return [*sizes, max_batch_size]


class DecodeGraphs:
    """Owns the static decode inputs and the captured graphs (with their output tensors)."""

    def __init__(self, step: DecodeStep, device: torch.device, max_batch_size: int, max_blocks: int) -> None:
        self.step = step
        self.device = device
        self.buckets = bucket_sizes(max_batch_size)
        self.max_blocks = max_blocks
        size = self.buckets[-1]
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((size, max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket_for(self, batch: DecodeBatch) -> int | None:
        if batch.block_tables.shape[1] > self.max_blocks:
            return None
        return next((size for size in self.buckets if size >= batch.num_seqs), None)

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        bucket = self.bucket_for(batch)
        if bucket is None:
            return self.step(batch)
        self.fill(batch, bucket)
        captured = self.graphs.get(bucket)
        if captured is None:
            captured = self.graphs[bucket] = self._capture(bucket)
        graph, logits = captured
        graph.replay()
        return logits[: batch.num_seqs].clone()

    def fill(self, batch: DecodeBatch, bucket: int) -> None:
        """Copy `batch` into the static inputs' first rows and pad them to `bucket` rows."""
        num_seqs, width = batch.num_seqs, batch.block_tables.shape[1]
        self.input_ids[:num_seqs].copy_(batch.input_ids)
        self.input_ids[num_seqs:bucket].zero_()
        self.positions[:num_seqs].copy_(batch.positions)
        self.positions[num_seqs:bucket].zero_()
        self.slot_mapping[:num_seqs].copy_(batch.slot_mapping)
        self.slot_mapping[num_seqs:bucket].fill_(-1)
        self.block_tables[:bucket].zero_()
        self.block_tables[:num_seqs, :width].copy_(batch.block_tables)
        self.seq_lens[:num_seqs].copy_(batch.seq_lens)
        self.seq_lens[num_seqs:bucket].fill_(1)

    def static_batch(self, bucket: int) -> DecodeBatch:
        return DecodeBatch(input_ids=self.input_ids[:bucket], positions=self.positions[:bucket],
                           slot_mapping=self.slot_mapping[:bucket], block_tables=self.block_tables[:bucket],
                           seq_lens=self.seq_lens[:bucket])

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        static = self.static_batch(bucket)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(NUM_WARMUP_STEPS):
                self.step(static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = self.step(static)
        return graph, logits
