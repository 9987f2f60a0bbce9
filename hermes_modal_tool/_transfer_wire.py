"""The wire of a streamed transfer (see :mod:`.filetransfer`): the :class:`Transfer` record,
one request of a stream, and the two pipelines: chunks sent with at most :data:`DEPTH`
unanswered, chunks asked for at most :data:`DOWN_DEPTH` ahead."""

from __future__ import annotations

import asyncio
import hashlib
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from .errors import TransferError, UsageError
from .slots import Slot

if TYPE_CHECKING:
    from ._backend_view import BackendView
    from .sandbox import Sandbox

#: Bytes per upload chunk (one binary frame each; the agent's download chunks are its own,
#: ``agent/files/streambase.CHUNK_BYTES``).
CHUNK_BYTES = 512 * 1024
#: Chunks of an upload the agent has not answered yet. It answers a file's chunk as it
#: arrives (while 2 MiB or less wait for its writer, ``agent/files/streamin.AHEAD_BYTES``),
#: so this window is what is on the way: what a neighbour's call, written after it, waits
#: behind (512 KiB; main: up to 1 MiB, 4 chunks of 256 KiB answered once written, with
#: the agent's writer waiting for chunks 92% of the time by py-spy). A wider window moves
#: more and delays the neighbours: ``benchmarks/transfer.py --mb 256`` on the loaded 2-core
#: machine, runs back to back: 1 chunk of 512 KiB 256/244 MB/s, neighbour's echo p50
#: 2.1/1.9 ms, p99 5.9/4.8; 2 chunks 277/309/292/303 MB/s, p50 2.9/2.5/2.8/2.6 ms, p99
#: 6.5/6.4/6.9/6.4; 2 of 1 MiB p99 6.7-15.5; main 259/289 MB/s, p50 2.0/1.6, p99 4.7/4.9.
DEPTH = 1
#: Chunk requests of a download ahead of the chunks taken: more than the agent lets wait
#: in the pipe (``agent/files/streamout.PIPE_BACKLOG``) and reads ahead (``READ_AHEAD``,
#: 4), so that a request is always there when the agent has a chunk to send (main: 4).
DOWN_DEPTH = 8
#: Bytes of a download's chunks that may wait for its writer thread (``_Sink``) before
#: the loop stops taking more: 8 of the agent's chunks of 256 KiB (with the window, the
#: 4 MiB a download held before).
SINK_BYTES = 2 * 1024 * 1024
#: Chunks of a local file read (and hashed) per worker-thread hand-off on upload (the
#: host holds at most the window, the rest of this batch and the next: 4.5 MiB).
READ_BATCH = 4
#: Where a file's SHA-256 is computed on each end: in a thread of its own beside the
#: thread that reads or writes the file (True), in that thread (False), or, None, as each
#: end's cores allow (a thread of its own from ``agent/files/hashthread.MIN_CORES`` cores:
#: it raises what a core per stage can move and costs more CPU in all).
HASH_THREAD: bool | None = None
#: Seconds the agent has to answer one chunk (or to open, or to finish a stream).
CHUNK_WAIT_S = 300.0


@dataclass(frozen=True)
class Transfer:
    """What an upload or download moved.

    Attributes:
        remote_path: the slot's path as given.
        bytes: bytes moved by this call (after ``offset``; a directory: its files' bytes).
        size: bytes of the file, or of all files of a directory.
        files: files moved (1 for a file).
        sha256: the whole file's SHA-256 (hex), checked on both ends; None for a directory
            (its tar stream is checked the same way).
        seconds: wall time of the transfer.
        skipped: entries of a directory left out (links leading out of it, devices,
            FIFOs, sockets; on download also files not owned by the slot).
        kept: a resumed directory's files found complete on the receiving end (same
            size, SHA-256 and mode) and not sent; their bytes count in ``size``, not in
            ``bytes``.
    """

    remote_path: str
    bytes: int
    size: int
    files: int
    sha256: str | None
    seconds: float
    skipped: int = 0
    kept: int = 0

    @property
    def mb_per_s(self) -> float:
        """Megabytes (10^6 bytes) moved per second."""
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


class ChunkRing:
    """The buffers an upload's chunks are made in, used again and again: a ring of
    ``size`` buffers of ``chunk_bytes``, each made when first needed (a small file takes
    one). The chunks a worker thread made as fresh ``bytes`` came from memory that the
    thread's malloc arena gave back to the kernel when the loop freed them, so each
    chunk's pages were faulted in anew: 240 page faults per MiB, a quarter of the host's
    CPU per MiB of an upload on the 2-core machine (``benchmarks/transfer.py``). The
    user of a ring fills a buffer again only once what was sent of it is encoded
    (:func:`_put`) and hashed."""

    def __init__(self, size: int, chunk_bytes: int) -> None:
        self.size, self.chunk_bytes = size, chunk_bytes
        self.bufs: list[bytearray] = []
        self.taken = 0

    def next(self) -> bytearray:
        """The next buffer of the ring (made if new)."""
        i = self.taken % self.size
        self.taken += 1
        if i == len(self.bufs):
            self.bufs.append(bytearray(self.chunk_bytes))
        return self.bufs[i]

    def give_back(self) -> None:
        """Take back the last :meth:`next` (its read found the end of the file): the next
        one gives the same buffer, and a buffer that call made is let go."""
        self.taken -= 1
        if len(self.bufs) > self.taken:
            self.bufs.pop()


def hash_thread_field() -> dict[str, bool]:
    """The ``hash_thread`` field of a file stream's opening request (:data:`HASH_THREAD`;
    none when it is None: the agent decides)."""
    return {} if HASH_THREAD is None else {"hash_thread": HASH_THREAD}


def _where(backend: BackendView, slot: Slot) -> tuple[Sandbox, int]:
    pool = backend._pools.get(slot.profile)
    if pool is None:
        raise UsageError(f"slot {slot.slot_id} does not belong to this backend")
    rec = pool.record_of(slot)
    return rec.sandbox, rec.index


async def _ask(sb: Sandbox, message: dict[str, Any], what: str) -> dict[str, Any]:
    """One request of a transfer; its ``result`` (with the ``blob`` of a binary reply).

    Raises:
        TransferError: the agent refused it, did not answer, or its sandbox died.
    """
    return await sb.ask(message, CHUNK_WAIT_S, what, TransferError)


def _put(sb: Sandbox, message: dict[str, Any], what: str) -> asyncio.Future[dict[str, Any]]:
    """One chunk request of an upload, sent now: encoded, its ``blob`` copied out, before
    this returns (so the blob's buffer may be used again: :class:`ChunkRing`);
    the future of its ``result``, as :func:`_ask` gives it."""
    mid, fut = sb.submit(message, CHUNK_WAIT_S)
    return asyncio.ensure_future(sb.answer(mid, fut, what, TransferError))


async def _close(sb: Sandbox, op: str, sid: str) -> None:
    """Tell the agent the stream is over (it drops it); never raises."""
    try:
        await asyncio.wait_for(sb.request({"op": op, "stream": sid, "abort": True}, 30.0), 35.0)
    except Exception:  # noqa: BLE001 - best effort: the sandbox may be gone
        pass


def _count(slot: Slot, op: str) -> None:
    slot._calls[op] = slot._calls.get(op, 0) + 1  # the usage ledger's calls by tool


def _prefix_sha(fh: IO[bytes], n: int) -> hashlib._Hash:
    digest = hashlib.sha256()
    left = n
    while left:
        piece = fh.read(min(left, CHUNK_BYTES))
        if not piece:
            raise TransferError(f"the local file has fewer than offset={n} bytes")
        digest.update(piece)
        left -= len(piece)
    return digest


async def _send(sb: Sandbox, sid: str, chunks: AsyncIterator[bytes | memoryview], what: str) -> dict[str, Any]:
    """Send ``chunks`` on upload stream ``sid``, at most :data:`DEPTH` unanswered; end it;
    return the agent's last result. The stream is closed on failure. Each chunk is
    encoded before the next is taken, so a chunk may be a view of a buffer that the
    chunks' producer fills again once the next one is asked for."""
    inflight: deque[asyncio.Future] = deque()
    ok = False
    try:
        async for chunk in chunks:
            inflight.append(_put(sb, {"op": "upload", "stream": sid, "blob": chunk}, what))
            if len(inflight) >= DEPTH:
                await inflight.popleft()
        while inflight:
            await inflight.popleft()
        end = await _ask(sb, {"op": "upload", "stream": sid, "end": True}, what)
        ok = True
        return end
    finally:
        await _cancel(inflight)
        if not ok:
            await _close(sb, "upload", sid)


async def _cancel(inflight: deque[asyncio.Future]) -> None:
    """Cancel the chunk requests still in flight and wait for them to end (a stream that
    stops early, by error or cancellation, leaves no request behind)."""
    for fut in inflight:
        fut.cancel()
    if inflight:
        await asyncio.gather(*inflight, return_exceptions=True)


class _Sink:
    """A download's writer: a thread of its own that hands each chunk to ``sink`` in order,
    so the loop only queues a chunk (before: a worker-thread hand-off per batch of chunks,
    a future and a wakeup each: 4% of the host's loop in a download by py-spy). The loop
    waits only while more than :data:`SINK_BYTES` wait for the thread; the thread wakes
    it, once, when half of that is written. ``sink``'s exception ends the thread and is
    raised on the loop at the next :meth:`put` or at :meth:`close`."""

    def __init__(self, sink: Callable[[bytes], Any]) -> None:
        self.sink = sink
        self.loop = asyncio.get_running_loop()
        self.items: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.queued = 0  # bytes put (on the loop)
        self.written = 0  # bytes handed to sink (by the thread, under the lock)
        self.error: BaseException | None = None
        self.wake: asyncio.Future[None] | None = None
        self.ended: asyncio.Future[None] = self.loop.create_future()
        self.thread = threading.Thread(target=self._run, name="hermes-modal-tool-download", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                blob = self.items.get()
                if blob is None:
                    return
                if self.error is None:
                    try:
                        self.sink(blob)
                    except BaseException as exc:  # noqa: BLE001 - raised on the loop
                        self.error = exc
                with self.lock:
                    self.written += len(blob)
                    wake = self.wake
                    if wake is not None and (self.error is not None
                                             or self.queued - self.written <= SINK_BYTES // 2):
                        self.wake = None
                        self.loop.call_soon_threadsafe(_set_done, wake)
        finally:
            self.loop.call_soon_threadsafe(_set_done, self.ended)

    async def put(self, blob: bytes) -> None:
        """Queue ``blob``; wait while more than :data:`SINK_BYTES` wait. Raises ``sink``'s error."""
        if self.error is not None:
            raise self.error
        self.queued += len(blob)
        self.items.put(blob)
        with self.lock:
            if self.queued - self.written <= SINK_BYTES:
                return
            self.wake = wake = self.loop.create_future()
        await wake
        if self.error is not None:
            raise self.error

    async def close(self) -> None:
        """Let the thread write what waits and end; wait for it. Raises ``sink``'s error."""
        self.items.put(None)
        await asyncio.shield(self.ended)
        if self.error is not None:
            raise self.error


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _receive(sb: Sandbox, sid: str, sink: Callable[[bytes], Any], what: str) -> dict[str, Any]:
    """Ask for the chunks of download stream ``sid`` (at most :data:`DOWN_DEPTH` ahead) and
    hand them to ``sink``, in order, in a thread of the download's own (:class:`_Sink`),
    written while the next ones come; return the last result (``eof``). Memory: the
    window and at most :data:`SINK_BYTES` waiting for the thread. The stream is closed at
    the end."""
    inflight: deque[asyncio.Future] = deque()
    writer = _Sink(sink)
    try:
        while True:
            while len(inflight) < DOWN_DEPTH:
                inflight.append(asyncio.ensure_future(_ask(sb, {"op": "download", "stream": sid}, what)))
            got = await inflight.popleft()
            blob = got.pop("blob", b"")
            if blob:
                await writer.put(blob)
            if got.get("eof"):
                await writer.close()
                return got
    finally:
        await _cancel(inflight)
        # Stopped early: let the thread finish its write before the file closes (its
        # error, if any, gives way to the one already on its way).
        await asyncio.gather(writer.close(), return_exceptions=True)
        await _close(sb, "download", sid)
