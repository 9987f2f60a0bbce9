"""Streamed file transfer between the host and a slot: ``backend.upload`` / ``backend.download``.

A file moves in chunks of :data:`CHUNK_BYTES`, each a *binary frame* on the sandbox's
existing stream (``protocol``: the bytes as they are, no base64, no JSON), at most
:data:`DEPTH` in flight: that is the flow control, and it bounds memory on both ends.
On each end the file is read or written, and hashed, in a thread (the host's worker
threads; a thread of the transfer's own in the agent, ``agent/files/streams.py``),
never on an event loop, so a transfer does not stall the calls of the other slots.
The agent opens the slot's file as the file tools do, through the slot's own view with
the slot's credentials, never through a link the slot made. Both ends hash what passed
(SHA-256, of the whole file) and compare at the end: no second read of the file.

A directory moves as one tar stream (``agent/files/tarstream.py``, the same code on both
ends): packed from a directory descriptor without following links, unpacked beneath
one, the receiver refusing the whole stream at the first hostile member (``..``, an
absolute name, a link leading out, a name below a link, a hard link to anything but an
earlier file, a device node). Links leading out of the directory, devices, FIFOs and
sockets are left out by the sender and counted in :attr:`Transfer.skipped`.

Resuming: ``offset=N`` continues an upload whose remote file holds exactly the first N
bytes (the agent compares their SHA-256 with the host's first), or a download into a
local file holding the first N bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import queue
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from .agent.files import tarstream
from .errors import SandboxError, TransferError, UsageError
from .slots import Slot

if TYPE_CHECKING:
    from ._backend_view import BackendView
    from .sandbox import Sandbox

#: Bytes per chunk (one binary frame each). A neighbour's call waits behind at most
#: DEPTH chunks on the shared stream (benchmarks/transfer.py measures it).
CHUNK_BYTES = 1024 * 1024
#: Chunks in flight at once per transfer.
DEPTH = 4
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
    """

    remote_path: str
    bytes: int
    size: int
    files: int
    sha256: str | None
    seconds: float
    skipped: int = 0

    @property
    def mb_per_s(self) -> float:
        """Megabytes (10^6 bytes) moved per second."""
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


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
    try:
        reply = await sb.request(message, CHUNK_WAIT_S)
    except SandboxError as exc:
        raise TransferError(f"{what}: {exc}") from None
    if not reply.get("ok"):
        raise TransferError(f"{what}: {reply.get('error')}")
    result = reply.get("result") or {}
    if "blob" in reply:
        result["blob"] = reply["blob"]
    return result


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


async def _send(sb: Sandbox, sid: str, chunks: AsyncIterator[bytes], what: str) -> dict[str, Any]:
    """Send ``chunks`` on upload stream ``sid``, at most :data:`DEPTH` unanswered; end it;
    return the agent's last result. The stream is closed on failure."""
    inflight: deque[asyncio.Future] = deque()
    ok = False
    try:
        async for chunk in chunks:
            inflight.append(asyncio.ensure_future(
                _ask(sb, {"op": "upload", "stream": sid, "blob": chunk}, what)))
            if len(inflight) >= DEPTH:
                await inflight.popleft()
        while inflight:
            await inflight.popleft()
        end = await _ask(sb, {"op": "upload", "stream": sid, "end": True}, what)
        ok = True
        return end
    finally:
        for fut in inflight:
            fut.cancel()
        if inflight:
            await asyncio.gather(*inflight, return_exceptions=True)
        if not ok:
            await _close(sb, "upload", sid)


async def _file_chunks(fh: IO[bytes], digest: hashlib._Hash, sent: list[int]) -> AsyncIterator[bytes]:
    def next_chunk() -> bytes:
        piece = fh.read(CHUNK_BYTES)
        digest.update(piece)
        return piece

    while True:
        piece = await asyncio.to_thread(next_chunk)
        if not piece:
            return
        sent[0] += len(piece)
        yield piece


async def upload_file(backend: BackendView, slot: Slot, fh: IO[bytes], remote: str,
                      offset: int = 0) -> Transfer:
    """Send the rest of binary file object ``fh`` (from ``offset``) to ``remote`` in the slot."""
    started = time.monotonic()
    sb, index = _where(backend, slot)
    digest = await asyncio.to_thread(_prefix_sha, fh, offset) if offset else hashlib.sha256()
    what = f"{remote}: upload into slot {slot.slot_id}"
    _count(slot, "upload")
    opened = await _ask(sb, {"op": "upload", "slot": index, "path": remote, "kind": "file", "offset": offset,
                             "sha256": digest.hexdigest() if offset else None}, what)
    sent = [0]
    there = await _send(sb, opened["stream"], _file_chunks(fh, digest, sent), what)
    if there["size"] != offset + sent[0] or there["sha256"] != digest.hexdigest():
        raise TransferError(f"{remote}: checksum differs after the upload (slot: {there['size']} bytes, "
                            f"sha256 {there['sha256']}; host: {offset + sent[0]} bytes, {digest.hexdigest()})")
    return Transfer(remote, sent[0], offset + sent[0], 1, digest.hexdigest(), time.monotonic() - started)


async def _tar_chunks(top: str, counts: list[int], digest: hashlib._Hash) -> AsyncIterator[bytes]:
    """Local directory ``top`` as a tar stream in chunks, packed in a worker thread (at most
    two chunks ahead); ``counts`` gets ``[files, bytes, skipped]``."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=2)
    stop: list[bool] = []

    def put(item: bytes | None) -> None:
        if not stop:
            asyncio.run_coroutine_threadsafe(ready.put(item), loop).result()

    class Out:
        buf = bytearray()

        def write(self, data: bytes) -> int:
            self.buf += data
            while len(self.buf) >= CHUNK_BYTES and not stop:
                chunk = bytes(self.buf[:CHUNK_BYTES])
                del self.buf[:CHUNK_BYTES]
                digest.update(chunk)
                put(chunk)
            if stop:
                raise TransferError("the upload stopped")
            return len(data)

    def work() -> None:
        out = Out()
        try:
            fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise UsageError(f"cannot read {top!r}: {exc.strerror}") from None
        try:
            counts[:] = tarstream.pack(fd, out)
        finally:
            os.close(fd)
        if out.buf:
            digest.update(bytes(out.buf))
            put(bytes(out.buf))

    packing = loop.run_in_executor(None, work)
    packing.add_done_callback(lambda _f: loop.call_soon(ready.put_nowait, None) if not stop else None)
    try:
        while True:
            item = await ready.get()
            if item is None:
                break
            yield item
        await packing
    finally:
        stop.append(True)
        while not packing.done():  # let a producer blocked on a full queue go on (and stop)
            while not ready.empty():
                ready.get_nowait()
            await asyncio.sleep(0.01)


async def _upload_tree(backend: BackendView, slot: Slot, top: str, remote: str) -> Transfer:
    started = time.monotonic()
    counts = [0, 0, 0]
    digest = hashlib.sha256()
    there = await upload_tar_stream(backend, slot, _tar_chunks(top, counts, digest), remote,
                                    f"{remote}: upload of directory {top} into slot {slot.slot_id}")
    if there["sha256"] != digest.hexdigest() or there["files"] != counts[0]:
        raise TransferError(f"{remote}: the tar stream differs after the upload (slot: {there['files']} files, "
                            f"sha256 {there['sha256']}; host: {counts[0]} files, {digest.hexdigest()})")
    return Transfer(remote, counts[1], counts[1], counts[0], None, time.monotonic() - started, counts[2])


async def upload_tar_stream(backend: BackendView, slot: Slot, chunks: AsyncIterator[bytes], remote: str,
                            what: str) -> dict[str, Any]:
    """Send a tar stream (``chunks``) to be unpacked beneath the slot's directory ``remote``
    (made with its parents); return the agent's result (``files``, ``bytes``, ``sha256`` of
    the stream). The agent refuses a hostile member (``agent/files/tarstream.py``).

    Raises:
        TransferError: refused, or the slot's file system refused a write.
    """
    sb, index = _where(backend, slot)
    _count(slot, "upload")
    opened = await _ask(sb, {"op": "upload", "slot": index, "path": remote, "kind": "tar"}, what)
    return await _send(sb, opened["stream"], chunks, what)


async def _receive(sb: Sandbox, sid: str, sink: Callable[[bytes], Any], what: str) -> dict[str, Any]:
    """Ask for the chunks of download stream ``sid`` (at most :data:`DEPTH` ahead) and hand
    each to ``sink`` in a worker thread, in order; return the last result (``eof``). The
    stream is closed at the end."""
    inflight: deque[asyncio.Future] = deque()
    try:
        while True:
            while len(inflight) < DEPTH:
                inflight.append(asyncio.ensure_future(_ask(sb, {"op": "download", "stream": sid}, what)))
            got = await inflight.popleft()
            blob = got.pop("blob", b"")
            if blob:
                await asyncio.to_thread(sink, blob)
            if got.get("eof"):
                return got
    finally:
        for fut in inflight:
            fut.cancel()
        if inflight:
            await asyncio.gather(*inflight, return_exceptions=True)
        await _close(sb, "download", sid)


async def _open_download(backend: BackendView, slot: Slot, remote: str, offset: int
                         ) -> tuple[Sandbox, dict[str, Any], str]:
    sb, index = _where(backend, slot)
    what = f"{remote}: download from slot {slot.slot_id}"
    _count(slot, "download")
    opened = await _ask(sb, {"op": "download", "slot": index, "path": remote, "offset": offset}, what)
    return sb, opened, what


async def download_file(backend: BackendView, slot: Slot, remote: str, fh: IO[bytes],
                        offset: int = 0, opened: tuple[Sandbox, dict[str, Any], str] | None = None) -> Transfer:
    """Write ``remote`` (from ``offset``) to binary file object ``fh``, positioned at ``offset``."""
    started = time.monotonic()
    sb, info, what = opened or await _open_download(backend, slot, remote, offset)
    if info["kind"] != "file":
        await _close(sb, "download", info["stream"])
        raise UsageError(f"{remote} is a directory in slot {slot.slot_id}: download it to a local "
                         "directory path")
    digest = hashlib.sha256()
    if offset:
        fh.seek(0)
        digest = await asyncio.to_thread(_prefix_sha, fh, offset)
    got = [0]

    def write(piece: bytes) -> None:
        fh.write(piece)
        digest.update(piece)
        got[0] += len(piece)

    there = await _receive(sb, info["stream"], write, what)
    await asyncio.to_thread(fh.flush)
    if there["size"] != offset + got[0] or there["sha256"] != digest.hexdigest():
        raise TransferError(f"{remote}: checksum differs after the download (slot: {there['size']} "
                            f"bytes, sha256 {there['sha256']}; host: {offset + got[0]} bytes, "
                            f"{digest.hexdigest()})")
    return Transfer(remote, got[0], offset + got[0], 1, digest.hexdigest(), time.monotonic() - started)


class _BlobReader:
    """Chunks handed over by the loop (``queue``), read by :func:`tarstream.unpack` in its thread."""

    def __init__(self) -> None:
        self.items: queue.Queue[bytes | None] = queue.Queue(maxsize=DEPTH)
        self.view = memoryview(b"")
        self.ended = False

    def read(self, n: int = -1) -> bytes:
        while not self.view:
            if self.ended:
                return b""
            item = self.items.get()
            if item is None:
                self.ended = True
                return b""
            self.view = memoryview(item)
        n = len(self.view) if n is None or n < 0 else n
        out, self.view = self.view[:n].tobytes(), self.view[n:]
        return out


async def _download_tree(backend: BackendView, slot: Slot, remote: str, top: str,
                         opened: tuple[Sandbox, dict[str, Any], str]) -> Transfer:
    started = time.monotonic()
    sb, info, what = opened
    try:
        await asyncio.to_thread(os.makedirs, top, exist_ok=True)
        fd = await asyncio.to_thread(os.open, top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        await _close(sb, "download", info["stream"])
        raise UsageError(f"cannot write {top!r}: {exc.strerror}") from None
    reader = _BlobReader()
    digest = hashlib.sha256()

    def unpack() -> tuple[int, int]:
        try:
            return tarstream.unpack(reader, fd)
        finally:
            os.close(fd)
            while not reader.ended:  # drain, so that the loop's puts never block
                reader.view = memoryview(b"")
                reader.read(1)

    loop = asyncio.get_running_loop()
    unpacking = loop.run_in_executor(None, unpack)

    def feed(blob: bytes) -> None:
        digest.update(blob)
        if unpacking.done():
            return  # it failed: its error is raised below
        reader.items.put(blob)

    try:
        there = await _receive(sb, info["stream"], feed, what)
    finally:
        await asyncio.to_thread(reader.items.put, None)
        try:
            made, size = await unpacking
        except tarstream.TarRefused as exc:
            raise TransferError(f"{remote}: the slot's tar stream was refused: {exc}; nothing was "
                                f"written outside {top}") from None
        except OSError as exc:
            raise TransferError(f"{remote}: cannot write below {top}: {exc}") from None
    if there["sha256"] != digest.hexdigest() or there["files"] != made:
        raise TransferError(f"{remote}: the tar stream differs after the download (slot: {there['files']} "
                            f"files, sha256 {there['sha256']}; host: {made} files, {digest.hexdigest()})")
    return Transfer(remote, size, size, made, None, time.monotonic() - started, int(there.get("skipped", 0)))


async def upload(backend: BackendView, slot: Slot, local: Any, remote: str, offset: int = 0) -> Transfer:
    """``backend.upload``: a local file or directory path, or a binary file object."""
    _check(slot, remote, offset)
    if isinstance(local, (str, os.PathLike)):
        path = os.fspath(local)
        if await asyncio.to_thread(os.path.isdir, path):
            if offset:
                raise UsageError("offset applies to a single file, not a directory")
            return await _upload_tree(backend, slot, path, remote)
        try:
            fh = await asyncio.to_thread(open, path, "rb")
        except OSError as exc:
            raise UsageError(f"cannot read {path!r}: {exc.strerror}") from None
        with fh:
            return await upload_file(backend, slot, fh, remote, offset)
    if isinstance(local, (bytes, bytearray, memoryview)):
        return await upload_file(backend, slot, io.BytesIO(bytes(local)), remote, offset)
    if not hasattr(local, "read"):
        raise UsageError(f"upload() takes a local path, bytes or a binary file object, got {type(local).__name__}")
    if offset and hasattr(local, "seek"):
        local.seek(0)
    return await upload_file(backend, slot, local, remote, offset)


async def download(backend: BackendView, slot: Slot, remote: str, local: Any, offset: int = 0) -> Transfer:
    """``backend.download``: into a local path (file, or directory for a remote directory)
    or a binary file object."""
    _check(slot, remote, offset)
    if not isinstance(local, (str, os.PathLike)) and not hasattr(local, "write"):
        raise UsageError("download() of a directory needs a local directory path; of a file, "
                         f"a path or a binary file object (got {type(local).__name__})")
    opened = await _open_download(backend, slot, remote, offset)
    _sb, info, _what = opened
    if not isinstance(local, (str, os.PathLike)):
        return await download_file(backend, slot, remote, local, offset, opened)
    path = os.fspath(local)
    if info["kind"] == "dir":
        return await _download_tree(backend, slot, remote, path, opened)
    mode = "r+b" if offset else "wb"
    try:
        fh = await asyncio.to_thread(open, path, mode)
    except OSError as exc:
        await _close(_sb, "download", info["stream"])
        raise UsageError(f"cannot write {path!r}: {exc.strerror}") from None
    with fh:
        if offset:
            fh.truncate(offset)
        return await download_file(backend, slot, remote, fh, offset, opened)


def _check(slot: Slot, remote: str, offset: int) -> None:
    if not isinstance(slot, Slot):
        raise UsageError(f"expected a Slot, got {type(slot).__name__}")
    if not isinstance(remote, str) or not remote or "\x00" in remote:
        raise UsageError(f"remote path must be a non-empty string, got {remote!r:.80}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise UsageError(f"offset must be a whole number of bytes >= 0, got {offset!r}")


class TransferMethods:
    """``ToolBackend.upload`` and ``ToolBackend.download`` (a mixin; needs ``_check_open``)."""

    async def upload(self, slot: Slot, local: Any, remote_path: str, offset: int = 0) -> Transfer:
        """Copy a local file or directory (or bytes, or a binary file object) into a slot.

        Streamed in binary chunks of :data:`CHUNK_BYTES` over the sandbox's stream, at
        most :data:`DEPTH` in flight, written through the slot's own view with its
        credentials; the whole file's SHA-256 is compared on both ends at the end. A
        directory goes as one tar stream, unpacked beneath the slot's directory (a
        hostile member refuses the stream: see the module doc).

        Args:
            slot: a held slot.
            local: a path (``str``/``PathLike``: a file, or a directory: its files,
                directories and the symbolic links that stay inside it, with their modes),
                ``bytes``, or a binary file object.
            remote_path: where in the slot (relative: to its workspace); parents are made.
            offset: resume: the slot's file already holds the first ``offset`` bytes of
                ``local`` (checked by checksum); only the rest is sent.

        Returns:
            A :class:`Transfer` (bytes moved, size, SHA-256, seconds).

        Raises:
            TransferError: a chunk failed (no space, permission), the resume point does
                not match, or the checksums differ.
            UsageError: bad arguments, a local file that cannot be read, a slot not held.
        """
        self._check_open()  # type: ignore[attr-defined]
        from . import tracing

        with tracing.span("upload", {"slot_id": getattr(slot, "slot_id", None), "path": remote_path,
                                     "offset": offset}) as span:
            done = await upload(self, slot, local, remote_path, offset)  # type: ignore[arg-type]
            tracing.set_attributes(span, {"bytes": done.bytes, "files": done.files, "sha256": done.sha256})
            return done

    async def download(self, slot: Slot, remote_path: str, local: Any, offset: int = 0) -> Transfer:
        """Copy a file or directory of a slot to a local path (or a binary file object).

        Streamed as :meth:`upload`, read through the slot's own view; a directory comes
        as a tar stream, unpacked beneath ``local`` relative to its descriptor; the
        slot's files are untrusted: a name with ``..``, an absolute name, a link leading
        out, a file below a link, a hard link to outside or a device node refuses the
        stream (:class:`TransferError`), and nothing is written outside ``local``.

        Args:
            slot: a held slot.
            remote_path: the slot's file or directory (relative: to its workspace).
            local: a local path (a directory for a directory), or a writable binary file
                object (for a file; readable too when ``offset`` is given).
            offset: resume: the local file holds the first ``offset`` bytes already (it
                is cut to that length, and its checksum covers them).

        Returns:
            A :class:`Transfer`.

        Raises:
            TransferError: the slot's file cannot be read, it changed during the
                download, the checksums differ, or a directory's stream was refused.
            UsageError: bad arguments, a local path that cannot be written, a slot not held.
        """
        self._check_open()  # type: ignore[attr-defined]
        from . import tracing

        with tracing.span("download", {"slot_id": getattr(slot, "slot_id", None), "path": remote_path,
                                       "offset": offset}) as span:
            done = await download(self, slot, remote_path, local, offset)  # type: ignore[arg-type]
            tracing.set_attributes(span, {"bytes": done.bytes, "files": done.files, "sha256": done.sha256})
            return done
