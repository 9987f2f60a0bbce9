"""The host <-> agent framing: any JSON object survives any split; bad frames are refused."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hermes_modal_tool import protocol
from hermes_modal_tool.protocol import (
    MAX_FRAME_BYTES,
    TOOL_ARGS,
    FrameDecoder,
    ProtocolError,
    check_args,
    encode,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)
messages = st.dictionaries(st.text(max_size=10), json_values, max_size=6)


@settings(max_examples=100, deadline=None)
@given(msgs=st.lists(messages, min_size=1, max_size=6), data=st.data())
def test_round_trip_split_anywhere(msgs, data):
    stream = b"".join(encode(m) for m in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    decoder = FrameDecoder()
    got = []
    prev = 0
    for cut in [*cuts, len(stream)]:
        got.extend(decoder.feed(stream[prev:cut]))
        prev = cut
    assert got == msgs
    assert decoder.pending == 0


@settings(max_examples=25, deadline=None)
@given(msg=messages)
def test_byte_at_a_time(msg):
    frame = encode(msg)
    decoder = FrameDecoder()
    got = []
    for i in range(len(frame)):
        got.extend(decoder.feed(frame[i:i + 1]))
        if i < len(frame) - 1:
            assert got == []
    assert got == [msg]


def test_partial_frame_is_kept_pending():
    frame = encode({"id": 1, "op": "status"})
    decoder = FrameDecoder()
    assert decoder.feed(frame[:5]) == []
    assert decoder.pending == 5
    assert decoder.feed(frame[5:]) == [{"id": 1, "op": "status"}]


def test_oversized_length_is_rejected_before_reading_the_payload():
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError, match="exceeds"):
        decoder.feed(struct.pack(">I", MAX_FRAME_BYTES + 1))


@pytest.mark.parametrize("payload", [b"[1, 2]", b'"text"', b"42", b"null", b"true"])
def test_non_object_frames_are_rejected(payload):
    with pytest.raises(ProtocolError, match="not a JSON object"):
        FrameDecoder().feed(struct.pack(">I", len(payload)) + payload)


@pytest.mark.parametrize("payload", [b"{not json", b"\xff\xfe{}", b""])
def test_undecodable_frames_are_rejected(payload):
    with pytest.raises(ProtocolError):
        FrameDecoder().feed(struct.pack(">I", len(payload)) + payload)


def test_encode_is_length_prefixed_json():
    frame = encode({"id": 7, "op": "call", "args": {"command": "echo é"}})
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert json.loads(frame[4:].decode("utf-8")) == {"id": 7, "op": "call",
                                                     "args": {"command": "echo é"}}


wide_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(msg=st.dictionaries(st.text(max_size=10), wide_values, max_size=6))
def test_the_c_codec_writes_and_reads_what_json_does(msg):
    """The cached C encoder and scanner (protocol._fast_codec) against ``json`` itself:
    the same text out, the same values back, NaN, infinities, integers past 64 bits and
    lone surrogates included."""
    from hermes_modal_tool import protocol

    assert protocol._ENCODE_C is not None and protocol._SCAN is not None  # CPython has both
    text = json.dumps(msg, separators=(",", ":"), ensure_ascii=False)
    frame = encode(msg)
    assert frame[4:] == text.encode("utf-8", "surrogatepass")
    [back] = FrameDecoder().feed(frame)
    assert json.dumps(back, separators=(",", ":"), ensure_ascii=False) == text


@pytest.mark.parametrize("payload, expected", [(b' {"a":1}', {"a": 1}), (b'{"a":1} \n', {"a": 1})])
def test_whitespace_around_a_frame_is_json_whitespace(payload, expected):
    assert FrameDecoder().feed(struct.pack(">I", len(payload)) + payload) == [expected]


def test_a_message_that_refers_to_itself_is_refused():
    msg: dict = {"id": 1}
    msg["self"] = msg
    with pytest.raises(ProtocolError, match="cannot be sent as JSON"):
        encode(msg)


arg_values = (st.none() | st.booleans() | st.integers(-5, 70_000) | st.floats() | st.text(max_size=5)
              | st.just("a\x00b") | st.sampled_from(["text", "bytes", "base64"])
              | st.dictionaries(st.text(max_size=3), st.text(max_size=3) | st.integers(), max_size=2))
arg_names = st.sampled_from(sorted({k for spec in TOOL_ARGS.values() for k in spec}) + ["zzz"])


@settings(max_examples=2000, deadline=None)
@given(tool=st.sampled_from([*TOOL_ARGS, "nope"]), args=st.dictionaries(arg_names, arg_values, max_size=4))
def test_check_args_fast_pass_says_what_the_full_check_says(tool, args):
    """check_args' one pass over the given arguments (toolargs._all_fine) against the
    full check in TOOL_ARGS order: the same answer for every tool and argument."""
    from hermes_modal_tool import toolargs

    assert check_args(tool, args) == toolargs._first_problem(tool, TOOL_ARGS.get(tool), args)


def test_a_binary_frame_carries_raw_bytes_beside_plain_frames():
    blob = bytes(range(256)) * 4099  # every byte value, no base64
    frames = (protocol.encode({"id": 1, "op": "status"})
              + protocol.encode({"id": 2, "op": "upload", "stream": "u1", "blob": blob})
              + protocol.encode({"id": 3, "op": "download", "blob": b""}))
    assert len(frames) < len(blob) + 200  # the bytes as they are
    d = protocol.FrameDecoder()
    got = []
    for i in range(0, len(frames), 65536):  # as a pipe hands them over
        got += d.feed(frames[i:i + 65536])
    assert got == [{"id": 1, "op": "status"}, {"id": 2, "op": "upload", "stream": "u1", "blob": blob},
                   {"id": 3, "op": "download", "blob": b""}] and d.pending == 0
    bad = protocol.HEADER.pack(8 | protocol.BINARY_FLAG) + protocol.HEADER.pack(99) + b"{}xx"
    with pytest.raises(protocol.ProtocolError, match="JSON length 99 passes its end"):
        protocol.FrameDecoder().feed(bad)


def test_a_frame_completed_in_the_buffer_is_decoded_from_it_and_a_bad_one_stays_at_the_front():
    """A large frame comes in several reads and is decoded straight from the decoder's
    buffer once whole (no copy of the buffer first); a bad frame after it, in the same
    read, raises and stays at the front with what follows, whatever view of the buffer the
    error's traceback still holds."""
    big = protocol.encode({"id": 1, "blob": b"x" * 300_000})
    bad = protocol.HEADER.pack(5) + b"{bad}"
    after = protocol.encode({"id": 2})
    d = protocol.FrameDecoder()
    assert d.feed(big[:70_000]) == [] and d.pending == 70_000
    tail = big[70_000:] + protocol.encode({"id": 9}) + b"\x00\x00"
    got = d.feed(tail)
    assert got == [{"id": 1, "blob": b"x" * 300_000}, {"id": 9}] and d.pending == 2
    d = protocol.FrameDecoder()
    d.feed(big[:70_000])
    with pytest.raises(ProtocolError, match="undecodable frame") as caught:
        d.feed(big[70_000:] + bad + after)
    assert caught.value.__traceback__ is not None and d.pending == len(bad) + len(after)
