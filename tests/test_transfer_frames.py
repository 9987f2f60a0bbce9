"""The frame decoder with a transfer's traffic: large binary frames (chunks) that come in
pieces of any size, mixed with small frames, decode to exactly the messages sent; a
large frame is assembled in a buffer of its own size, and a length word alone never
makes the decoder hold more than it was given."""

from __future__ import annotations

import random

import pytest

from hermes_modal_tool import protocol


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_frames_in_pieces_decode_to_what_was_sent(seed):
    rng = random.Random(seed)
    for _ in range(40):
        msgs = []
        for i in range(rng.randint(1, 10)):
            roll = rng.random()
            if roll < 0.5:
                size = rng.choice([0, 7, 65536, 262144, 262151, 1 << 20])
                msgs.append({"id": i, "op": "upload", "blob": rng.randbytes(size)})
            elif roll < 0.6:
                msgs.append({"id": i, "op": "call", "text": "t" * rng.choice([10, 70000])})
            else:
                msgs.append({"id": i, "op": "ping"})
        stream = b"".join(protocol.encode(m) for m in msgs)
        decoder = protocol.FrameDecoder()
        got, at = [], 0
        while at < len(stream):
            n = rng.choice([1, 3, 4, 5, 4096, 65536, 262144, 262200, 1 << 22])
            got += decoder.feed(stream[at:at + n])
            at += n
            assert decoder.pending <= at  # never more than it was given
        assert got == msgs and decoder.pending == 0


def test_a_length_word_alone_holds_only_what_came():
    decoder = protocol.FrameDecoder()
    frame = protocol.encode({"id": 1, "op": "upload", "blob": bytes(300_000)})
    assert decoder.feed(frame[:10]) == [] and decoder.pending == 10
    huge = protocol.HEADER.pack((protocol.MAX_WHOLE_BYTES + 1) | protocol.BINARY_FLAG)
    other = protocol.FrameDecoder()
    assert other.feed(huge + b"x" * 6) == [] and other.pending == 10
    assert other._whole is None  # no buffer of the declared size made for a length word
    [msg] = decoder.feed(frame[10:])
    assert msg["blob"] == bytes(300_000) and isinstance(msg["blob"], (bytes, bytearray))
