"""An upload reads its file into a ring of buffers used again and again
(``_transfer_wire.ChunkRing``), not into a fresh ``bytes`` per chunk: a chunk's buffer is
read into again only once the sender has encoded that chunk and, with a hash thread,
once the thread has hashed it. Checked here on the chunks as the sender takes them
(each copied at once: a buffer filled again too early shows as other bytes) and end to
end, file and checksum in the slot, with the hash in the reader's thread and in a
thread of its own."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os

import pytest
from support import bash

from hermes_modal_tool import _transfer_wire, filetransfer
from hermes_modal_tool.agent.files.hashthread import AHEAD, HashThread, Inline

CHUNK = 4096


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(filetransfer, "CHUNK_BYTES", CHUNK)
    monkeypatch.setattr(_transfer_wire, "CHUNK_BYTES", CHUNK)


async def take_all(fh, digest) -> tuple[list[bytes], set[int], int]:
    """Every chunk of ``fh`` as the sender takes it (copied at once, a millisecond between
    chunks so that the reader thread runs as far ahead as it may), the buffers the chunks
    were views of, and the bytes counted as sent."""
    sent = [0]
    seen: list[bytes] = []
    buffers: set[int] = set()
    async for piece in filetransfer._file_chunks(fh, digest, sent):
        seen.append(bytes(piece))
        if isinstance(piece, memoryview):
            buffers.add(id(piece.obj))
        await asyncio.sleep(0.001)
    return seen, buffers, sent[0]


@pytest.mark.parametrize("threaded", [False, True], ids=["inline-hash", "hash-thread"])
async def test_chunks_come_from_a_ring_of_buffers_and_arrive_intact(small_chunks, threaded):
    data = os.urandom(50 * CHUNK + 123)  # many times round the ring, a short last chunk
    digest = HashThread() if threaded else Inline()
    try:
        seen, buffers, sent = await take_all(io.BytesIO(data), digest)
        assert b"".join(seen) == data and sent == len(data)
        assert [len(c) for c in seen[-2:]] == [CHUNK, 123]
        assert digest.hexdigest() == hashlib.sha256(data).hexdigest()
    finally:
        digest.close()
    # Two batches' worth (the one being sent, the one being read), and the chunks a hash
    # thread may hold: no more buffers than that, however long the file.
    assert len(buffers) == 2 * _transfer_wire.READ_BATCH + (AHEAD if threaded else 0)


@pytest.mark.parametrize(("size", "made"), [(100, 1), (CHUNK, 1), (3 * CHUNK, 3), (8 * CHUNK, 8),
                                            (30 * CHUNK, 8)])
async def test_a_ring_makes_only_the_buffers_a_file_needs(small_chunks, monkeypatch, size, made):
    """The read that finds the end of the file gives its buffer back (one made for it
    is let go): a small file holds one buffer, a long one the ring's eight."""
    rings = []

    class Watched(_transfer_wire.ChunkRing):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            rings.append(self)

    monkeypatch.setattr(filetransfer, "ChunkRing", Watched)
    data = os.urandom(size)
    seen, _, _ = await take_all(io.BytesIO(data), Inline())
    assert b"".join(seen) == data and [len(r.bufs) for r in rings] == [made]


async def test_a_file_object_without_readinto_gives_bytes_of_its_own(small_chunks):
    class ReadOnly:
        """A caller's object that has ``read`` alone (and hands out a bytearray)."""

        def __init__(self, data: bytes) -> None:
            self.fh = io.BytesIO(data)

        def read(self, n: int) -> bytearray:
            return bytearray(self.fh.read(n))

    data = os.urandom(10 * CHUNK)
    sent = [0]
    pieces = [p async for p in filetransfer._file_chunks(ReadOnly(data), Inline(), sent)]
    assert all(type(p) is bytes for p in pieces) and b"".join(pieces) == data


@pytest.mark.parametrize("threaded", [False, True], ids=["inline-hash", "hash-thread"])
async def test_an_upload_through_the_ring_lands_whole(make_backend, small_chunks, monkeypatch, threaded):
    monkeypatch.setattr(_transfer_wire, "HASH_THREAD", threaded)
    backend = await make_backend()
    slot = await backend.acquire("t")
    data = os.urandom(64 * CHUNK + 7)
    done = await backend.upload(slot, io.BytesIO(data), "ring.bin")
    assert done.size == len(data) and done.sha256 == hashlib.sha256(data).hexdigest()
    r = await bash(backend, slot, "sha256sum ring.bin | cut -c1-64")
    assert r.output.strip() == done.sha256


async def test_the_sender_is_done_with_a_chunk_when_it_takes_the_next(make_backend, small_chunks, monkeypatch):
    """The contract the ring rests on, alone: chunks from one buffer filled anew for each
    chunk, four unanswered at once, still land whole (a sender that encoded a chunk
    later than taking the next would send the last chunk's bytes four times over)."""
    monkeypatch.setattr(_transfer_wire, "DEPTH", 4)
    monkeypatch.setattr(_transfer_wire, "HASH_THREAD", False)

    async def one_buffer(fh, digest, sent):
        buf = bytearray(CHUNK)
        while n := fh.readinto(buf):
            view = memoryview(buf)[:n]
            digest.update(view)
            sent[0] += n
            yield view

    monkeypatch.setattr(filetransfer, "_file_chunks", one_buffer)
    backend = await make_backend()
    slot = await backend.acquire("t")
    data = os.urandom(40 * CHUNK)
    done = await backend.upload(slot, io.BytesIO(data), "one.bin")
    assert done.size == len(data) and done.sha256 == hashlib.sha256(data).hexdigest()
    r = await bash(backend, slot, "sha256sum one.bin | cut -c1-64")
    assert r.output.strip() == done.sha256

