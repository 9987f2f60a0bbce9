"""protocol.FrameDecoder / encode given random and hostile bytes.

Whatever arrives, in whatever splits: the decoder returns messages or raises
ProtocolError, never another exception; valid frames after arbitrary splitting
decode to exactly what was encoded.
"""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hermes_modal_tool.protocol import (
    MAX_FRAME_BYTES,
    FrameDecoder,
    ProtocolError,
    decode_payload,
    encode,
)

SETTINGS = settings(max_examples=50, deadline=None, database=None)


def feed_all(chunks: list[bytes]) -> list[dict]:
    d = FrameDecoder()
    out: list[dict] = []
    for c in chunks:
        out += d.feed(c)
    return out


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False)]


@SETTINGS
@given(data=st.binary(max_size=200), cuts=st.lists(st.integers(0, 400), max_size=6))
def test_random_bytes_give_messages_or_protocol_error(data: bytes, cuts: list[int]) -> None:
    try:
        msgs = feed_all(split(data, cuts))
    except ProtocolError:
        return
    assert all(isinstance(m, dict) for m in msgs)


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


@SETTINGS
@given(payload=st.binary(max_size=64), cuts=st.lists(st.integers(0, 100), max_size=4))
def test_random_payloads_in_valid_frames(payload: bytes, cuts: list[int]) -> None:
    try:
        msgs = feed_all(split(frame(payload), cuts))
    except ProtocolError:
        # Refused: then it is not a JSON object (a refused object would be a lost message).
        try:
            value = json.loads(payload.decode("utf-8", "surrogatepass"))
        except ValueError:  # (UnicodeDecodeError is one)
            return
        assert not isinstance(value, dict), payload
        return
    assert msgs == [json.loads(payload.decode("utf-8", "surrogatepass"))]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
messages = st.dictionaries(st.text(max_size=8), json_values, max_size=5)


@SETTINGS
@given(msgs=st.lists(messages, min_size=1, max_size=4), junk=st.binary(min_size=1, max_size=40),
       cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_good_frames_then_junk_decode_then_fail_cleanly(msgs: list[dict], junk: bytes, cuts: list[int]) -> None:
    """The good frames before the junk are delivered intact (before or with a ProtocolError)."""
    data = b"".join(encode(m) for m in msgs) + junk
    d = FrameDecoder()
    got: list[dict] = []
    try:
        for c in split(data, cuts):
            got += d.feed(c)
    except ProtocolError:
        pass
    assert got == msgs[: len(got)]
    expected = json.loads(json.dumps(msgs))  # what JSON makes of them (e.g. int keys)
    assert got == expected[: len(got)]


@pytest.mark.parametrize("payload", [
    b"", b"null", b"[]", b"1", b'"x"', b"{", b'{"a":}', b"\xff\xfe", b'{"a": NaN}', b"\x00",
    b'{"a":"\\ud800"}', b'{"a":1}{"b":2}', b" " * 10, "{\"\u00e9\":1}".encode("latin-1"),
    b'{"a":' * 5000 + b"1" + b"}" * 5000,
])
def test_hostile_payloads(payload: bytes) -> None:
    try:
        msgs = FrameDecoder().feed(frame(payload))
    except ProtocolError as exc:
        assert str(exc)
        return
    assert all(isinstance(m, dict) for m in msgs)


@pytest.mark.parametrize("payload", [b"[" * 100_000 + b"]" * 100_000,
                                     b'{"a":' * 100_000 + b"1" + b"}" * 100_000])
def test_deeply_nested_payload_is_a_protocol_error_not_a_recursion_error(payload: bytes) -> None:
    try:
        decode_payload(payload)
    except RecursionError as exc:  # pragma: no cover - the failure this test is about
        pytest.fail(f"RecursionError escaped decode_payload: {exc}")
    except ProtocolError as exc:
        assert str(exc).startswith("undecodable frame: "), exc  # refused for its depth
    else:  # pragma: no cover - the other failure: a 100,000-deep payload accepted
        pytest.fail("decode_payload accepted a 100,000-deep payload")
    # Positive control: the same shapes, shallow, decode (the dict) or are refused as
    # not an object (the list), not as undecodable.
    assert decode_payload(b'{"a":{"a":1}}') == {"a": {"a": 1}}
    with pytest.raises(ProtocolError, match="not a JSON object"):
        decode_payload(b"[[]]")


def test_oversized_length_header_is_refused_before_buffering() -> None:
    d = FrameDecoder()
    with pytest.raises(ProtocolError, match=str(MAX_FRAME_BYTES + 1)):
        d.feed(struct.pack(">I", MAX_FRAME_BYTES + 1))
    with pytest.raises(ProtocolError, match="exceeds"):
        FrameDecoder().feed(b"\xff\xff\xff\xff")


@pytest.mark.parametrize("message", [{"a": b"x"}, {"a": {1, 2}}, {"a": object()}, {("t",): 1}])
def test_encode_of_non_json_is_a_protocol_error_naming_the_value(message: dict) -> None:
    """encode() documents ProtocolError for frames it cannot make; a value JSON cannot
    carry should be the same error (naming the type), not a bare TypeError."""
    with pytest.raises(ProtocolError):
        encode(message)


@pytest.mark.parametrize("message", [[1], "x", None, 5])
def test_encode_of_a_non_object(message: object) -> None:
    """A frame is one JSON object; encode() must not make frames the decoder refuses."""
    try:
        data = encode(message)
    except (ProtocolError, TypeError):
        return
    with pytest.raises(ProtocolError):
        FrameDecoder().feed(data)
    pytest.fail(f"encode({message!r}) made a frame every decoder refuses")
