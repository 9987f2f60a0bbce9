"""Streamed file transfer between the host and a slot: ``backend.upload`` / ``backend.download``.

A file moves in chunks, each a *binary frame* on the sandbox's existing stream
(``protocol``: the bytes as they are, no base64, no JSON). Up: chunks of
:data:`CHUNK_BYTES` (512 KiB), at most :data:`DEPTH` (1) unanswered (the agent answers
a file's chunk as it arrives while 2 MiB or less wait for its writer); down: the agent's
chunks of 256 KiB, at most :data:`~._transfer_wire.DOWN_DEPTH` (8) asked ahead, the agent
letting at most 256 KiB wait in the pipe (``agent/files/streamout.PIPE_BACKLOG``). That is
the flow control, and it bounds memory: on the host at most 4.5 MiB per upload (the
window, the rest of a batch of :data:`~._transfer_wire.READ_BATCH` chunks read ahead and
the next batch) and 4 MiB per download (the window, and chunks waiting for the download's
writer thread, :data:`~._transfer_wire.SINK_BYTES`); in
the agent 2.5 MiB per upload (chunks answered on arrival, ``agent/files/streamin.AHEAD_BYTES``,
and the window, queued for the stream's thread) and 1 MiB per
download (``READ_AHEAD`` chunks read ahead) besides what waits in the pipe; with hash
threads (``agent/files/hashthread.py``), up to ``AHEAD`` (8) more chunks on each end.
On each end the file is read or written, and hashed, in a thread (on upload the host's
worker threads; on download a thread of the download's own, which the loop hands each
chunk without a wakeup; in the agent a thread of the transfer's own, which writes the
chunks queued when it wakes in one ``writev`` and counts them without waking the loop,
``agent/files/streamin.py``), never on an event loop, so a transfer does not stall the
calls of the other slots.
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
import contextlib
import hashlib
import io
import os
import time
from collections.abc import AsyncIterator
from typing import IO, TYPE_CHECKING, Any

from . import _transfer_wire as wire
from ._transfer_resume import download_resumed, upload_file_resumed, upload_tree_resumed
from ._transfer_tree import download_tree, upload_tar_stream, upload_tree
from ._transfer_wire import (
    CHUNK_BYTES,
    DEPTH,
    ChunkRing,
    Transfer,
    _ask,
    _close,
    _count,
    _prefix_sha,
    _receive,
    _send,
    _where,
)
from .agent.files.hashthread import AHEAD, HashThread, Inline, hasher
from .errors import TransferError, UsageError
from .slots import Slot

__all__ = ["CHUNK_BYTES", "DEPTH", "Transfer", "TransferMethods", "download", "upload", "upload_tar_stream", "wire"]

if TYPE_CHECKING:
    from ._backend_view import BackendView
    from .sandbox import Sandbox


def _read_chunk(fh: IO[bytes], ring: ChunkRing | None) -> bytes | memoryview:
    """The next chunk of ``fh`` (empty at its end): read into ``ring``'s next buffer, or,
    ``ring`` None (a file object without ``readinto``), a ``bytes`` of its own."""
    if ring is not None:
        buf = ring.next()
        n = fh.readinto(buf)
        if not n:
            ring.give_back()
            return b""
        return memoryview(buf)[:n]
    piece = fh.read(CHUNK_BYTES)
    if piece and not isinstance(piece, bytes):  # a caller's object that may reuse its buffer
        piece = bytes(piece)
    return piece or b""


async def _file_chunks(fh: IO[bytes], digest: HashThread | Inline,
                       sent: list[int]) -> AsyncIterator[bytes | memoryview]:
    """The rest of ``fh`` in chunks of :data:`CHUNK_BYTES`, read in worker threads
    :data:`~._transfer_wire.READ_BATCH` chunks per hand-off (one thread hop per batch, not
    per chunk) and hashed in ``digest``'s own thread meanwhile, the next batch read while
    this one is sent: at most two batches held besides the window (and the chunks the hash
    thread holds, ``agent/files/hashthread.AHEAD``).

    The chunks are views of a :class:`~._transfer_wire.ChunkRing` (a fresh ``bytes`` per
    chunk made in a worker thread cost 240 page faults per MiB): a chunk's buffer is read
    into again two batches later, once the consumer has taken every chunk of the batch
    between (it must be done with a chunk when it asks for the next:
    ``_transfer_wire._send`` encodes each before), and, with a hash thread, once that
    thread is past it (it holds at most ``AHEAD`` chunks, so the ring has that many
    buffers more)."""
    ring = None
    if callable(getattr(fh, "readinto", None)):
        ring = ChunkRing(2 * wire.READ_BATCH + (AHEAD if isinstance(digest, HashThread) else 0), CHUNK_BYTES)

    def next_batch() -> list[bytes | memoryview]:
        batch: list[bytes | memoryview] = []
        for _ in range(wire.READ_BATCH):
            piece = _read_chunk(fh, ring)
            if not piece:
                break
            digest.update(piece)
            batch.append(piece)
        return batch

    ahead: asyncio.Future[list[bytes | memoryview]] | None = asyncio.ensure_future(asyncio.to_thread(next_batch))
    try:
        while ahead is not None:
            batch = await ahead
            ahead = asyncio.ensure_future(asyncio.to_thread(next_batch)) if len(batch) == wire.READ_BATCH else None
            for piece in batch:
                sent[0] += len(piece)
                yield piece
    finally:
        if ahead is not None:  # stopped early: the file is not closed under a read
            await asyncio.gather(ahead, return_exceptions=True)


async def upload_file(backend: BackendView, slot: Slot, fh: IO[bytes], remote: str,
                      offset: int = 0, meta: list[int] | None = None) -> Transfer:
    """Send the rest of binary file object ``fh`` (from ``offset``) to ``remote`` in the
    slot; ``meta``: ``[mode, mtime]`` the slot's file gets at the end (a resumed directory's)."""
    started = time.monotonic()
    sb, index = _where(backend, slot)
    prefix = await asyncio.to_thread(_prefix_sha, fh, offset) if offset else hashlib.sha256()
    what = f"{remote}: upload into slot {slot.slot_id}"
    _count(slot, "upload")
    ask = {"op": "upload", "slot": index, "path": remote, "kind": "file", "offset": offset,
           "sha256": prefix.hexdigest() if offset else None, **wire.hash_thread_field()}
    if meta is not None:
        ask["meta"] = meta
    opened = await _ask(sb, ask, what)
    sent = [0]
    digest = hasher(prefix, wire.HASH_THREAD, "hermes-modal-tool-upload-sha256")
    try:
        async with contextlib.aclosing(_file_chunks(fh, digest, sent)) as chunks:
            there = await _send(sb, opened["stream"], chunks, what)
        sha256 = await asyncio.to_thread(digest.hexdigest)
    finally:
        digest.close()
    if there["size"] != offset + sent[0] or there["sha256"] != sha256:
        raise TransferError(f"{remote}: checksum differs after the upload (slot: {there['size']} bytes, "
                            f"sha256 {there['sha256']}; host: {offset + sent[0]} bytes, {sha256})")
    return Transfer(remote, sent[0], offset + sent[0], 1, sha256, time.monotonic() - started)


async def _open_download(backend: BackendView, slot: Slot, remote: str, offset: int
                         ) -> tuple[Sandbox, dict[str, Any], str]:
    sb, index = _where(backend, slot)
    what = f"{remote}: download from slot {slot.slot_id}"
    _count(slot, "download")
    opened = await _ask(sb, {"op": "download", "slot": index, "path": remote, "offset": offset,
                             **wire.hash_thread_field()}, what)
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
    prefix = hashlib.sha256()
    if offset:
        fh.seek(0)
        prefix = await asyncio.to_thread(_prefix_sha, fh, offset)
    got = [0]
    digest = hasher(prefix, wire.HASH_THREAD, "hermes-modal-tool-download-sha256")

    def write(piece: bytes) -> None:  # in the download's writer thread (_transfer_wire._Sink)
        digest.update(piece)  # hashed in its own thread while written here
        fh.write(piece)
        got[0] += len(piece)

    try:
        there = await _receive(sb, info["stream"], write, what)
        await asyncio.to_thread(fh.flush)
        sha256 = await asyncio.to_thread(digest.hexdigest)
    finally:
        digest.close()
    if there["size"] != offset + got[0] or there["sha256"] != sha256:
        raise TransferError(f"{remote}: checksum differs after the download (slot: {there['size']} "
                            f"bytes, sha256 {there['sha256']}; host: {offset + got[0]} bytes, {sha256})")
    return Transfer(remote, got[0], offset + got[0], 1, sha256, time.monotonic() - started)


async def upload(backend: BackendView, slot: Slot, local: Any, remote: str, offset: int = 0,
                 resume: bool = False) -> Transfer:
    """``backend.upload``: a local file or directory path, or a binary file object."""
    _check(slot, remote, offset, resume)
    if isinstance(local, (str, os.PathLike)):
        path = os.fspath(local)
        if await asyncio.to_thread(os.path.isdir, path):
            if offset:
                raise UsageError("offset applies to a single file, not a directory (resume=True "
                                 "resumes a directory)")
            if resume:
                return await upload_tree_resumed(backend, slot, path, remote, upload_file)
            return await upload_tree(backend, slot, path, remote)
        if resume:
            return await upload_file_resumed(backend, slot, path, remote, upload)
    if resume:
        raise UsageError(f"resume=True needs a local file or directory path, got {type(local).__name__} "
                         "(a file object resumes with offset=)")
    if isinstance(local, (str, os.PathLike)):
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


async def download(backend: BackendView, slot: Slot, remote: str, local: Any, offset: int = 0,
                   resume: bool = False) -> Transfer:
    """``backend.download``: into a local path (file, or directory for a remote directory)
    or a binary file object."""
    _check(slot, remote, offset, resume)
    if resume:
        if not isinstance(local, (str, os.PathLike)):
            raise UsageError("resume=True needs a local file or directory path, got "
                             f"{type(local).__name__} (a file object resumes with offset=)")
        return await download_resumed(backend, slot, remote, os.fspath(local), download, download_file)
    if not isinstance(local, (str, os.PathLike)) and not hasattr(local, "write"):
        raise UsageError("download() of a directory needs a local directory path; of a file, "
                         f"a path or a binary file object (got {type(local).__name__})")
    opened = await _open_download(backend, slot, remote, offset)
    _sb, info, _what = opened
    if not isinstance(local, (str, os.PathLike)):
        return await download_file(backend, slot, remote, local, offset, opened)
    path = os.fspath(local)
    if info["kind"] == "dir":
        return await download_tree(backend, slot, remote, path, opened)
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


def _check(slot: Slot, remote: str, offset: int, resume: bool = False) -> None:
    if not isinstance(slot, Slot):
        raise UsageError(f"expected a Slot, got {type(slot).__name__}")
    if not isinstance(remote, str) or not remote or "\x00" in remote:
        raise UsageError(f"remote path must be a non-empty string, got {remote!r:.80}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise UsageError(f"offset must be a whole number of bytes >= 0, got {offset!r}")
    if not isinstance(resume, bool):
        raise UsageError(f"resume must be True or False, got {resume!r:.80}")
    if resume and offset:
        raise UsageError(f"give offset= (a file) or resume=True (a directory), not both (offset={offset})")


class TransferMethods:
    """``ToolBackend.upload`` and ``ToolBackend.download`` (a mixin; needs ``_check_open``)."""

    async def upload(self, slot: Slot, local: Any, remote_path: str, offset: int = 0,
                     resume: bool = False) -> Transfer:
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
            resume: send only what the slot lacks (``_transfer_resume``; ``local`` a
                path). A directory: a file the slot has with the same size, SHA-256 and
                mode is kept (counted in :attr:`Transfer.kept`), a shorter file holding
                the first bytes of the local one (an interrupted upload's) is continued
                from its offset, everything else goes in the tar stream; nothing in the
                slot is deleted. A file: nothing when equal, the rest when the slot's
                holds its first bytes, else all of it.

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
            done = await self._upload(slot, local, remote_path, offset, resume)
            tracing.set_attributes(span, {"bytes": done.bytes, "files": done.files, "sha256": done.sha256})
            return done

    async def download(self, slot: Slot, remote_path: str, local: Any, offset: int = 0,
                       resume: bool = False) -> Transfer:
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
            resume: fetch only what ``local`` (a path) lacks, as :meth:`upload`'s
                ``resume``: a directory's files kept, continued from an offset, or
                fetched in the tar stream; a file kept, continued, or fetched whole.

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
            done = await self._download(slot, remote_path, local, offset, resume)
            tracing.set_attributes(span, {"bytes": done.bytes, "files": done.files, "sha256": done.sha256})
            return done

    async def _upload(self, slot: Slot, local: Any, remote_path: str, offset: int, resume: bool) -> Transfer:
        """The upload itself, in the span :meth:`upload` opens (host processes route it)."""
        return await upload(self, slot, local, remote_path, offset, resume)  # type: ignore[arg-type]

    async def _download(self, slot: Slot, remote_path: str, local: Any, offset: int, resume: bool) -> Transfer:
        """The download itself, in the span :meth:`download` opens (host processes route it)."""
        return await download(self, slot, remote_path, local, offset, resume)  # type: ignore[arg-type]
