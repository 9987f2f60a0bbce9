"""The threads that write a transfer's file: the agent's (an upload: the chunks queued
for it written with one ``writev`` each time it wakes) and the host's (a download: a
thread of the download's own, ``_transfer_wire._Sink``). A write that fails fails the
transfer with its reason, at once, whatever the window; nothing waits for an answer that
never comes."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import io
import os
import threading

import pytest
from support import bash

from hermes_modal_tool import TransferError, _transfer_wire


async def test_a_full_disk_fails_an_upload_with_many_chunks_on_the_way(make_backend, monkeypatch):
    """Eight chunks of 512 KiB in flight (4 MiB, past the 2 MiB the agent answers on
    arrival): the writer takes several at once; when their write fails, every request it
    took (and the end, if it took it) is answered with the reason."""
    monkeypatch.setattr(_transfer_wire, "DEPTH", 8)
    backend = await make_backend(slot_disk=16)
    slot = await backend.acquire("t")
    data = os.urandom(6 * 1024 * 1024)
    ok = await backend.upload(slot, data, "big.bin")  # positive control: with room, it goes
    assert ok.size == len(data)
    r = await bash(backend, slot, "dd if=/dev/zero of=fill bs=1M count=64 2>&1; sync")
    assert "No space" in r.output or "quota" in r.output.lower(), r.output
    with pytest.raises(TransferError, match="(?i)no space|quota"):
        await asyncio.wait_for(backend.upload(slot, data, "big2.bin"), 60)
    # The stream is gone and the slot still serves: the room made again, it goes.
    assert (await bash(backend, slot, "rm -f fill big2.bin")).success
    again = await asyncio.wait_for(backend.upload(slot, data[:3_000_000], "big2.bin"), 60)
    assert again.size == 3_000_000


class _FailsAfter(io.RawIOBase):
    """A local file object that takes ``room`` bytes, then fails as a full disk does."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.got = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        if len(self.got) + len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.got += data
        return len(data)


async def test_a_local_write_that_fails_fails_the_download_and_nothing_hangs(make_backend, monkeypatch):
    """The download's writer thread fails while the loop waits for it (a small
    ``SINK_BYTES``): the loop is woken and the download raises the writer's error; the
    stream is closed, and the next download goes."""
    monkeypatch.setattr(_transfer_wire, "SINK_BYTES", 64 * 1024)
    backend = await make_backend()
    slot = await backend.acquire("t")
    data = os.urandom(3 * 1024 * 1024)
    await backend.upload(slot, data, "f.bin")
    whole = io.BytesIO()
    done = await asyncio.wait_for(backend.download(slot, "f.bin", whole), 60)  # positive control
    assert whole.getvalue() == data and done.bytes == len(data)
    sink = _FailsAfter(1024 * 1024)
    with pytest.raises(OSError, match="No space"):
        await asyncio.wait_for(backend.download(slot, "f.bin", sink), 60)
    assert bytes(sink.got) == data[:len(sink.got)] and len(sink.got) <= 1024 * 1024
    again = io.BytesIO()
    await asyncio.wait_for(backend.download(slot, "f.bin", again), 60)
    assert again.getvalue() == data


class _Loop:
    """What an ``Upload`` stream asks of the agent's loop, run at once and recorded."""

    def __init__(self) -> None:
        self.sent: list[dict] = []

    def call_soon_threadsafe(self, fn, *args):
        fn(*args)

    def send(self, message: dict) -> None:
        self.sent.append(message)


def test_the_agent_answers_every_request_its_failed_writev_took():
    """Chunks that wait past what the agent answers on arrival carry their request ids;
    the writer takes the chunks and the end queued when it wakes, in one ``writev``. That
    write fails (a pipe with no reader: EPIPE, a real descriptor): each request it took,
    the end included, is answered with the reason, at once (the writer does not wait for
    more)."""
    from hermes_modal_tool.agent.files import streamin

    loop = _Loop()
    agent = type("Agent", (), {"loop": loop, "send": loop.send})()
    stream = streamin.Upload(agent, None, "s1", {"path": "f.bin"}, "file", 0)
    stream.open_id = None  # started
    for mid in (7, 8):
        stream.items.put(("data", mid, os.urandom(300_000)))
    stream.items.put(("end", 9, None))
    r, w = os.pipe()
    os.close(r)
    try:
        done: list[BaseException] = []

        def run() -> None:
            try:
                stream._write_chunks(w)
            except OSError as exc:
                done.append(exc)
                stream.failed(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "the writer waits for a request it already took"
    finally:
        os.close(w)
    assert done and done[0].errno == errno.EPIPE
    answered = {m["id"]: m for m in loop.sent}
    assert set(answered) == {7, 8, 9}, loop.sent
    assert all(not m["ok"] and "pipe" in m["error"].lower() for m in answered.values())


@pytest.mark.parametrize("own_thread", [True, False])
async def test_a_file_hashed_in_a_thread_of_its_own_or_not_round_trips(make_backend, monkeypatch, own_thread):
    """Each end hashes a file in a thread of its own (forced here: this machine has fewer
    than ``hashthread.MIN_CORES`` cores) or in the thread that reads or writes it; either
    way the SHA-256 is the file's, from an offset too, and a resume's first bytes count."""
    from hermes_modal_tool.agent.files import hashthread

    monkeypatch.setattr(_transfer_wire, "HASH_THREAD", own_thread)
    monkeypatch.setattr(_transfer_wire, "CHUNK_BYTES", 64 * 1024)
    made: list[str] = []
    real = hashthread.HashThread

    class Counted(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            made.append("host")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(hashthread, "HashThread", Counted)
    backend = await make_backend()
    slot = await backend.acquire("t")
    data = os.urandom(2_000_003)
    up = await backend.upload(slot, data, "f.bin")
    assert up.sha256 == hashlib.sha256(data).hexdigest()
    r = await bash(backend, slot, "sha256sum f.bin | cut -c1-64")
    assert r.output.strip() == up.sha256
    out = io.BytesIO()
    down = await backend.download(slot, "f.bin", out)
    assert out.getvalue() == data and down.sha256 == up.sha256
    # Resumed both ways: the first bytes hashed before the hash thread takes over.
    await backend.upload(slot, data[:700_000], "g.bin")
    rest = await backend.upload(slot, data, "g.bin", offset=700_000)
    assert rest.bytes == len(data) - 700_000 and rest.sha256 == up.sha256
    part = io.BytesIO(data[:900_000])
    part.seek(900_000)
    again = await backend.download(slot, "f.bin", part, offset=900_000)
    assert part.getvalue() == data and again.sha256 == up.sha256
    assert len(made) == (5 if own_thread else 0), made  # the host's side took the path asked


def test_a_hash_thread_hashes_in_order_and_ends():
    """``HashThread`` gives ``hashlib``'s SHA-256 of the chunks in the order handed over
    (more than its ``AHEAD`` of them, so the feeder waits for it), continues a digest
    already started, and ends its thread at ``hexdigest`` or ``close``."""
    from hermes_modal_tool.agent.files.hashthread import AHEAD, HashThread, hasher

    chunks = [os.urandom(100_000 + i) for i in range(AHEAD * 3)]
    head = hashlib.sha256(b"first bytes")
    h = HashThread(head.copy(), name="test-sha256")
    for c in chunks:
        h.update(c)
    assert h.hexdigest() == hashlib.sha256(b"first bytes" + b"".join(chunks)).hexdigest()
    assert not h._thread.is_alive()
    stopped = HashThread()
    stopped.update(chunks[0])
    stopped.close()
    stopped._thread.join(5)
    assert not stopped._thread.is_alive()
    with pytest.raises(ValueError):
        stopped.hexdigest()
    inline = hasher(head.copy(), own_thread=False)
    inline.update(chunks[0])
    assert inline.hexdigest() == hashlib.sha256(b"first bytes" + chunks[0]).hexdigest()
