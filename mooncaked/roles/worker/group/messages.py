"""RPC messages between the members of a prefill group (chunked pipeline parallelism, head.py / stage.py).

1. CPP_STAGE (first stage -> every later stage, server-streaming): one prompt's part for that stage: its length
   and reused prefix, the chunk size, where the prefix's blocks are (the stage reads its layers of them) and
   where each block's KV goes (the group's store, the decode host's store). The stage plans its KV and answers a
   first item (ready for chunks); once its last chunk is computed and its layers' writes are confirmed, a second
   one (done; the last stage adds the first token).
2. CPP_CHUNK (stage s -> stage s+1): chunk j's hidden states are in the sender's registered buffer at (segment,
   offset); the receiver reads them with the transfer engine (the bytes never ride the RPC frame) and replies
   once they are in its own buffer, which frees the sender's.
3. CPP_ABORT (first stage -> later stages): stop the prompt (another stage failed, or the request ended); the
   stage's CPP_STAGE stream then ends with an error once its in-flight writes have settled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mooncaked.roles.worker.kv.spans import StoreBlocks
from mooncaked.roles.worker.messages import SamplingSpec, TokenSample
from mooncaked.rpc import Message, Method


@dataclass(frozen=True)
class StageRequest(Message):
    request_id: str
    group: str
    stage: int
    first_layer: int  # the layers the first stage expects this stage to hold: checked against its own
    end_layer: int
    num_tokens: int  # the prompt's tokens
    num_prefix_blocks: int  # blocks reused: loaded from `sources`, not computed
    chunk_tokens: int
    sampling: SamplingSpec  # the last stage samples the first token with it
    sources: list[StoreBlocks] = field(default_factory=list)  # with the incarnation of the runs that granted them
    writes: list[StoreBlocks] = field(default_factory=list)
    # the prompt's token ids, sent to the last stage when its sampling reads the request's history (penalties,
    # min_tokens: roles/worker/sampling.py); [] otherwise
    token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StageItem(Message):
    is_done: bool  # False: planned, ready for chunks; True: computed and every write confirmed
    first_token: Optional[TokenSample] = None  # the last stage's, when done
    compute_s: float = 0.0  # this stage's forward time of the prompt


@dataclass(frozen=True)
class ChunkRequest(Message):
    request_id: str
    chunk_index: int
    endpoint: str  # the sender's transfer engine ("host:port")
    segment: str  # its registered hidden-state buffer
    offset: int
    num_tokens: int  # rows of hidden states; num_tokens * hidden_size * dtype size bytes


@dataclass(frozen=True)
class ChunkReply(Message):
    pass


@dataclass(frozen=True)
class StageAbort(Message):
    request_id: str
    reason: str = ""


@dataclass(frozen=True)
class StageAbortReply(Message):
    was_running: bool


CPP_STAGE = Method("cpp_stage", StageRequest, StageItem, is_streaming=True)
CPP_CHUNK = Method("cpp_chunk", ChunkRequest, ChunkReply)
CPP_ABORT = Method("cpp_abort", StageAbort, StageAbortReply)
CPP_METHODS = (CPP_STAGE, CPP_CHUNK, CPP_ABORT)
