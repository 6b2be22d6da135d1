"""Every conductor <-> worker message survives msgpack in both wire forms (roles/worker/messages.py)."""

from __future__ import annotations

import msgpack
import pytest

from mooncaked.roles.worker import messages as m
from mooncaked.roles.worker.kv.spans import StoreBlocks
from mooncaked.rpc.protocol import Message, decode_array, decode_message, encode_array, encode_message
from mooncaked.store.messages import WriteHandle

KEY = bytes(range(16))
SPEC = m.SamplingSpec(max_tokens=8, temperature=0.5, top_p=0.9, top_k=4, seed=3, stop_token_ids=[2],
                      ignore_eos=True, num_logprobs=1, num_sampled=2, priority=-3, is_batch=True,
                      presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2, min_p=0.05,
                      logit_bias=[m.TokenBias(5, -100.0), m.TokenBias(9, 2.5)], min_tokens=3,
                      grammar='{"grammars": []}', num_prompt_logprobs=2, num_sequences=3)
SAMPLE = m.TokenSample(7, -0.5, [7, 8], [-0.5, -1.5])
PROMPT_SAMPLE = m.TokenSample(9, -2.5, [7], [-0.5], rank=3)
DESTINATION = m.Destination(1, WriteHandle(4, KEY, 8192, 1 << 16))

SAMPLES: list[Message] = [
    SPEC, m.SamplingSpec(max_tokens=1), SAMPLE, DESTINATION,
    m.ReserveRequest("r1", [KEY], 20, 8, 5_000, is_inline_prefill=True, priority=2, is_batch=True),
    m.ReserveRequest("r1", [KEY], 20, 8, 5_000, conductor_run=7, num_sequences=4),
    m.ReserveReply(True, "", "s0", [DESTINATION], 1),
    m.UnreserveRequest("r1"), m.UnreserveReply(True),
    m.PrefillRequest("r1", [1, 2, 3], [KEY], SPEC, "s1", 1, "s0", [DESTINATION]),
    m.PrefillReply(SAMPLE, 16, 1, 0.25, 0.2), m.PrefillReply(SAMPLE, 0, 0, 0.5, 0.4, [PROMPT_SAMPLE], [SAMPLE]),
    m.DecodeRequest("r1", [1, 2, 3], [KEY], SPEC, SAMPLE),
    m.DecodeItem([SAMPLE], "length", 16), m.DecodeItem([SAMPLE], "", 0, [PROMPT_SAMPLE], sequence=2),
    m.DecodeRequest("r1", [1, 2, 3], [KEY], SPEC, SAMPLE, more_first_tokens=[SAMPLE, SAMPLE]),
    m.LoadRequest(), m.LoadRequest(7, device_cache_seq=3),
    m.LoadReply("prefill", 0, 0, 0, 10, 64, 0.01, device_cache_seq=4, device_keys_gained=[KEY],
                device_keys_lost=[bytes(16)], is_device_cache_dump=False),
    m.LoadReply("decode", 2, 1, 0, 10, 64, 0.01, 300, [1.0], [2.0], 0.5, ["r1"], 0.01),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda msg: type(msg).__name__)
def test_round_trip_through_msgpack(message: Message) -> None:
    as_map = msgpack.unpackb(msgpack.packb(encode_message(message)), raw=False)
    as_array = msgpack.unpackb(msgpack.packb(encode_array(message)), raw=False)
    assert decode_message(type(message), as_map) == message
    assert decode_array(type(message), as_array) == message


def test_an_older_sender_without_the_new_fields_decodes_to_their_defaults() -> None:
    wire = encode_message(SPEC)
    new_fields = ("priority", "is_batch", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                  "logit_bias", "min_tokens", "grammar", "num_prompt_logprobs", "num_sequences")
    for name in new_fields:
        del wire[name]
    defaults = m.SamplingSpec(max_tokens=1)
    assert decode_message(m.SamplingSpec, wire) == m.SamplingSpec(
        **{**SPEC.__dict__, **{name: getattr(defaults, name) for name in new_fields}})


def test_prefill_group_messages_round_trip() -> None:
    from mooncaked.roles.worker.group import messages as c

    span = StoreBlocks("s0", [0, 2], [0, 1 << 33], incarnation=0x5eed)
    samples: list[Message] = [
        span, StoreBlocks("d", [3], [64]),
        c.StageRequest("r1", "pg", 1, 15, 30, 8192, 2, 1024, SPEC, [span], [span, StoreBlocks("d", [3], [64])]),
        c.StageRequest("r1", "pg", 1, 15, 30, 3, 0, 1024, SPEC, token_ids=[4, 5, 6]),
        c.StageItem(False), c.StageItem(True, SAMPLE, 1.5),
        c.ChunkRequest("r1", 3, "127.0.0.1:4000", "p0/cpp-send", 1 << 20, 1024), c.ChunkReply(),
        c.StageAbort("r1", "stage 2 failed"), c.StageAbortReply(True),
    ]
    for message in samples:
        test_round_trip_through_msgpack(message)
    assert [method.name for method in c.CPP_METHODS] == ["cpp_stage", "cpp_chunk", "cpp_abort"]


def test_store_blocks_of_an_older_sender_without_the_incarnation_are_unchecked() -> None:
    """A sender from before StoreBlocks carried the incarnation sent three values: they decode with run 0."""
    assert decode_array(StoreBlocks, [StoreBlocks.VERSION, "s0", [1], [64]]) == StoreBlocks("s0", [1], [64], 0)
