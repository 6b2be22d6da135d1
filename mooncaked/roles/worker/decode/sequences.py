"""A DECODE call's sequences on their way into the batch, and their stream of items (role.py, steps 2 and 3).

1. `load_prefilled(worker, request, reservation)`: the prompt's blocks, from this host's store (the prefill
   instance wrote them), loaded into a request's pages layer by layer off the compute thread (but the leading
   full blocks the device prefix cache holds, read in place); the reserved full blocks are committed (cache on
   this host: `commit_prefilled`), and the prompt's full blocks stay in the device prefix cache once the request
   ends. `commit_only`: the DECODE of a request its prefill's first token ended (max_tokens 1) only commits.
2. `fork(worker, kv, request_id, max_tokens)`: a parallel sampling's further sequence: it reads the prompt's
   full-block pages in place, shared with the first sequence (the prompt was prefilled once; a page is freed
   when its last sequence ends), and takes pages of its own (its share of the reservation's) for a copy of the
   prompt's partial last block (copy-on-write: every sequence writes its next token there) and its output.
3. `stream_items(outbox, num_running, timeout_s)`: the loop's tokens of the call's running sequences, as DECODE
   items (one per sequence per drain, several tokens when the consumer lags), until every sequence has finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from mooncaked.model.sampling_params import SamplingParams
from mooncaked.roles.worker.decode.loop import Outbox, is_stop_token
from mooncaked.roles.worker.decode.reservations import Reservation, ReservationBook
from mooncaked.roles.worker.kv.request_kv import RequestKv
from mooncaked.roles.worker.kv.spans import StoreBlocks
from mooncaked.roles.worker.messages import FINISH_EOS, FINISH_LENGTH, DecodeItem, DecodeRequest, TokenSample
from mooncaked.roles.worker.sampling import sequence_params
from mooncaked.roles.worker.worker import Worker


async def load_prefilled(worker: Worker, request: DecodeRequest, reservation: Reservation) -> RequestKv:
    kv = RequestKv(worker, request.request_id, len(request.token_ids), reservation.request.max_tokens,
                   reserved_by=reservation.owner, block_keys=request.block_keys,
                   num_shareable_blocks=len(request.block_keys))
    try:
        index_of = {key: i for i, key in enumerate(request.block_keys)}
        blocks = [(index_of[loc.key], loc.offset) for loc in reservation.present]
        blocks += [(index_of[h.key], h.offset) for h in reservation.handles]
        if reservation.tail is not None:
            blocks.append((len(request.block_keys), reservation.tail.offset))
        blocks = [(i, offset) for i, offset in blocks if i >= kv.num_device_blocks]
        kv.start_loading([StoreBlocks(worker.stores.local_name, [i for i, _ in blocks], [o for _, o in blocks],
                                      reservation.incarnation)], kv.num_blocks if blocks else 0)
        await kv.wait_loaded()
        kv.mark_complete()
        await commit_prefilled(worker, reservation)
    except BaseException:
        await kv.release()
        raise
    return kv


async def commit_prefilled(worker: Worker, reservation: Reservation) -> None:
    """The prompt's full blocks the prefill instance wrote here become cache on this host (its store's commit)."""
    if reservation.handles:
        await worker.stores.local.commit([h.handle_id for h in reservation.handles])
        reservation.handles = []


async def commit_only(worker: Worker, reservations: ReservationBook, request: DecodeRequest,
                      reservation: Reservation, params: SamplingParams) -> AsyncIterator[DecodeItem]:
    """DECODE of a request its prefill's first tokens ended (max_tokens 1): no page is taken and nothing decodes;
    the prefilled blocks are committed, the reservation dropped, and each sequence's end reported."""
    try:
        await commit_prefilled(worker, reservation)
    finally:
        await reservations.drop(request.request_id)
    assert worker.loaded is not None
    for q, first in enumerate([request.first_token, *request.more_first_tokens]):
        assert first is not None
        is_stop = is_stop_token(sequence_params(params, q), first.token_id, worker.loaded.eos_token_ids)
        yield DecodeItem(tokens=[], finish_reason=FINISH_EOS if is_stop else FINISH_LENGTH, sequence=q)


async def fork(worker: Worker, kv: RequestKv, request_id: str, max_tokens: int, reserved_by: str = "") -> RequestKv:
    """A sequence of its own that shares `kv`'s full prompt pages and starts its partial last block from a copy
    (on the copy thread: no forward reads them); `reserved_by`: the reservation whose pages it takes."""
    assert worker.kv_pages is not None
    child = kv.fork(request_id, max_tokens, reserved_by=reserved_by)
    try:
        sources, targets = kv.tail_copy(child)
        if sources:
            await asyncio.get_running_loop().run_in_executor(worker.copy_thread, worker.kv_pages.copy_pages,
                                                             sources, targets)
    except BaseException:
        await child.release()
        raise
    return child


async def stream_items(outbox: Outbox, num_running: int, timeout_s: float) -> AsyncIterator[DecodeItem]:
    while num_running:
        entries = [await asyncio.wait_for(outbox.get(), timeout_s)]
        while not outbox.empty():
            entries.append(outbox.get_nowait())
        pending: dict[int, list[TokenSample]] = {}
        for entry in entries:
            if isinstance(entry, BaseException):
                raise entry
            sequence, sample, reason = entry
            pending.setdefault(sequence, []).append(sample)
            if reason:
                yield DecodeItem(tokens=pending.pop(sequence), finish_reason=reason, sequence=sequence)
                num_running -= 1
        for sequence, tokens in pending.items():
            yield DecodeItem(tokens=tokens, sequence=sequence)
