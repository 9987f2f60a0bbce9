"""Streamed file transfer between the host and a slot: ``backend.upload`` / ``backend.download``.

A file moves in chunks of :data:`CHUNK_BYTES`, each one tool call on the sandbox's
existing stream (``write_file`` with ``append``, ``read_artifact`` with ``offset``), at
most :data:`DEPTH` in flight: that is the flow control, and it bounds memory on both
ends (a chunk is read, encoded and written in worker threads, never on an event loop).
The agent writes and reads them as the file tools do, through the slot's own view with
the slot's credentials, never through a link the slot made. After the last chunk the
agent's SHA-256 of the whole file (the ``checksum`` op) must equal the host's.

A directory moves as its files, one at a time (with its empty directories); links are
left out and counted in :attr:`Transfer.skipped`. Resuming: ``offset=N`` continues an
upload whose remote file holds exactly the first N bytes (its checksum is compared
first), or a download into a local file holding the first N bytes.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import os
import posixpath
import shlex
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from .errors import TransferError, UsageError
from .slots import Slot

if TYPE_CHECKING:
    from ._backend_view import BackendView

#: Bytes per chunk (before base64): one tool call each. Small, so that a neighbour's call waits
#: behind at most DEPTH chunks on the shared stream (benchmarks/transfer.py: with 1 MiB x 4
#: a neighbour's echo took ~470 ms at the median during an upload on a loaded 2-core
#: machine, with 512 KiB x 2 ~55 ms, at the same MB/s).
CHUNK_BYTES = 512 * 1024
#: Chunks in flight at once per transfer.
DEPTH = 2
#: Seconds the agent has to checksum a file.
CHECKSUM_WAIT_S = 600.0


@dataclass(frozen=True)
class Transfer:
    """What an upload or download moved.

    Attributes:
        remote_path: the slot's path as given.
        bytes: bytes moved by this call (after ``offset``).
        size: bytes of the file, or of all files of a directory.
        files: files moved (1 for a file).
        sha256: the whole file's SHA-256 (hex), checked on both ends; None for a directory.
        seconds: wall time of the transfer.
        skipped: entries of a directory left out (symbolic links, special files).
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


async def _checksum(backend: BackendView, slot: Slot, path: str) -> dict[str, Any]:
    pool = backend._pools.get(slot.profile)
    if pool is None:
        raise UsageError(f"slot {slot.slot_id} does not belong to this backend")
    rec = pool.record_of(slot)
    reply = await rec.sandbox.request({"op": "checksum", "slot": rec.index, "path": path}, CHECKSUM_WAIT_S)
    if not reply.get("ok"):
        raise TransferError(f"{path}: cannot checksum it in slot {slot.slot_id}: {reply.get('error')}")
    return reply["result"]


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


async def _pipelined(calls: deque[Awaitable[Any]], call: Awaitable[Any]) -> None:
    """Keep at most :data:`DEPTH` calls in flight: add ``call``, await the oldest past it."""
    calls.append(asyncio.ensure_future(call))
    if len(calls) >= DEPTH:
        await calls.popleft()


async def _drain(calls: deque[Awaitable[Any]]) -> None:
    try:
        while calls:
            await calls.popleft()
    finally:
        for fut in calls:
            fut.cancel()  # type: ignore[union-attr]
        if calls:
            await asyncio.gather(*calls, return_exceptions=True)


async def upload_file(backend: BackendView, slot: Slot, fh: IO[bytes], remote: str,
                      offset: int = 0) -> Transfer:
    """Send the rest of binary file object ``fh`` (from ``offset``) to ``remote`` in the slot."""
    started = time.monotonic()
    digest = await asyncio.to_thread(_prefix_sha, fh, offset) if offset else hashlib.sha256()
    if offset:
        there = await _checksum(backend, slot, remote)
        if there["size"] != offset or there["sha256"] != digest.hexdigest():
            raise TransferError(f"{remote}: cannot resume at offset {offset}: the slot's file has "
                                f"{there['size']} bytes" + ("" if there["size"] != offset else
                                                            " that differ from the local file's first ones"))

    def next_chunk() -> tuple[bytes, str]:
        piece = fh.read(CHUNK_BYTES)
        digest.update(piece)
        return piece, base64.b64encode(piece).decode("ascii")

    async def send(content: str, append: bool) -> None:
        args = {"path": remote, "content": content, "encoding": "base64", "append": append}
        result = await backend.execute(slot, "write_file", args)
        if not result.success:
            raise TransferError(f"{remote}: a chunk could not be written: {result.error}; resume with "
                                "offset= the slot's file size")

    sent = 0
    calls: deque[Awaitable[Any]] = deque()
    try:
        first = offset == 0
        while True:
            piece, content = await asyncio.to_thread(next_chunk)
            if not piece and not first:
                break
            await _pipelined(calls, send(content, append=not first))
            first = False
            sent += len(piece)
            if not piece:
                break
    finally:
        await _drain(calls)
    there = await _checksum(backend, slot, remote)
    if there["size"] != offset + sent or there["sha256"] != digest.hexdigest():
        raise TransferError(f"{remote}: checksum differs after the upload (slot: {there['size']} bytes, "
                            f"sha256 {there['sha256']}; host: {offset + sent} bytes, {digest.hexdigest()})")
    return Transfer(remote, sent, offset + sent, 1, digest.hexdigest(), time.monotonic() - started)


async def download_file(backend: BackendView, slot: Slot, remote: str, fh: IO[bytes],
                        offset: int = 0) -> Transfer:
    """Write ``remote`` (from ``offset``) to binary file object ``fh``, positioned at ``offset``."""
    started = time.monotonic()
    digest = hashlib.sha256()
    if offset:
        fh.seek(0)
        digest = await asyncio.to_thread(_prefix_sha, fh, offset)

    async def read(at: int) -> tuple[bytes, int]:
        result = await backend.execute(slot, "read_artifact", {
            "path": remote, "encoding": "base64", "offset": at, "max_bytes": CHUNK_BYTES})
        if not result.success:
            raise TransferError(f"{remote}: cannot read it from slot {slot.slot_id}: {result.error}")
        data = await asyncio.to_thread(base64.b64decode, result.output)
        return data, int(result.metadata.get("size", 0))

    def write(piece: bytes) -> None:
        fh.write(piece)
        digest.update(piece)

    piece, size = await read(offset)
    got = 0
    pending: deque[asyncio.Future] = deque()
    at = offset + len(piece)
    try:
        while True:
            while len(pending) < DEPTH - 1 and at < size:
                pending.append(asyncio.ensure_future(read(at)))
                at += CHUNK_BYTES
            if piece:
                await asyncio.to_thread(write, piece)
                got += len(piece)
            if not pending:
                break
            piece, _ = await pending.popleft()
    finally:
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    await asyncio.to_thread(fh.flush)
    there = await _checksum(backend, slot, remote)
    if there["size"] != offset + got or there["sha256"] != digest.hexdigest():
        raise TransferError(f"{remote}: checksum differs after the download (slot: {there['size']} "
                            f"bytes, sha256 {there['sha256']}; host: {offset + got} bytes, "
                            f"{digest.hexdigest()}); did the file change meanwhile?")
    return Transfer(remote, got, offset + got, 1, digest.hexdigest(), time.monotonic() - started)


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
    listing = await backend.execute(slot, "list_files", {"path": remote, "max_entries": 1})
    is_dir = listing.success
    if not isinstance(local, (str, os.PathLike)):
        if is_dir or not hasattr(local, "write"):
            raise UsageError("download() of a directory needs a local directory path; of a file, "
                             f"a path or a binary file object (got {type(local).__name__})")
        return await download_file(backend, slot, remote, local, offset)
    path = os.fspath(local)
    if is_dir:
        if offset:
            raise UsageError("offset applies to a single file, not a directory")
        return await _download_tree(backend, slot, remote, path)
    mode = "r+b" if offset else "wb"
    try:
        fh = await asyncio.to_thread(open, path, mode)
    except OSError as exc:
        raise UsageError(f"cannot write {path!r}: {exc.strerror}") from None
    with fh:
        if offset:
            fh.truncate(offset)
        return await download_file(backend, slot, remote, fh, offset)


def _check(slot: Slot, remote: str, offset: int) -> None:
    if not isinstance(slot, Slot):
        raise UsageError(f"expected a Slot, got {type(slot).__name__}")
    if not isinstance(remote, str) or not remote or "\x00" in remote:
        raise UsageError(f"remote path must be a non-empty string, got {remote!r:.80}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise UsageError(f"offset must be a whole number of bytes >= 0, got {offset!r}")


def _plan_tree(top: str, remote: str) -> tuple[list[tuple[str, str]], list[str], int]:
    """A local directory's ``(local file, remote path)`` pairs, its empty directories (as
    remote paths) and how many entries are left out (links, special files)."""
    pairs: list[tuple[str, str]] = []
    empty: list[str] = []
    skipped = 0
    for dirpath, dirnames, filenames in os.walk(top):
        rel = os.path.relpath(dirpath, top)
        base = remote if rel == "." else posixpath.join(remote, *rel.split(os.sep))
        if not filenames and not dirnames:
            empty.append(base)
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            if os.path.islink(full) or not os.path.isfile(full):
                skipped += 1
            else:
                pairs.append((full, posixpath.join(base, name)))
        skipped += sum(1 for d in dirnames if os.path.islink(os.path.join(dirpath, d)))
    return pairs, empty, skipped


async def _upload_tree(backend: BackendView, slot: Slot, top: str, remote: str) -> Transfer:
    started = time.monotonic()
    pairs, empty, skipped = await asyncio.to_thread(_plan_tree, top, remote)
    total = files = 0
    for full, dest in pairs:
        fh = await asyncio.to_thread(open, full, "rb")
        with fh:
            done = await upload_file(backend, slot, fh, dest)
        total += done.bytes
        files += 1
    if empty:
        made = await backend.execute(slot, "bash", {"command": "mkdir -p -- " + " ".join(map(shlex.quote, empty))})
        if not made.success:
            raise TransferError(f"{remote}: cannot make its empty directories: {made.output or made.error}")
    return Transfer(remote, total, total, files, None, time.monotonic() - started, skipped)


async def _download_tree(backend: BackendView, slot: Slot, remote: str, top: str) -> Transfer:
    started = time.monotonic()
    listing = await backend.execute(slot, "list_artifacts", {"path": remote, "recursive": True,
                                                              "max_entries": 1_000_000})
    if not listing.success:
        raise TransferError(f"{remote}: cannot list it in slot {slot.slot_id}: {listing.error}")
    entries = listing.metadata.get("details") or []
    total = files = skipped = 0
    await asyncio.to_thread(os.makedirs, top, exist_ok=True)
    for entry in entries:
        rel = entry["path"]
        parts = [p for p in rel.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts) or "raw_path" in entry:
            skipped += 1  # never a path outside ``top`` (the slot names its files)
            continue
        dest = os.path.join(top, *parts)
        if entry.get("type") == "dir":
            await asyncio.to_thread(os.makedirs, dest, exist_ok=True)
        elif entry.get("type") == "file":
            await asyncio.to_thread(os.makedirs, os.path.dirname(dest), exist_ok=True)
            fh = await asyncio.to_thread(open, dest, "wb")
            with fh:
                done = await download_file(backend, slot, posixpath.join(remote, *parts), fh)
            total += done.bytes
            files += 1
        else:
            skipped += 1
    return Transfer(remote, total, total, files, None, time.monotonic() - started, skipped)


class TransferMethods:
    """``ToolBackend.upload`` and ``ToolBackend.download`` (a mixin; needs ``_check_open``)."""

    async def upload(self, slot: Slot, local: Any, remote_path: str, offset: int = 0) -> Transfer:
        """Copy a local file or directory (or bytes, or a binary file object) into a slot.

        Streamed in chunks of :data:`CHUNK_BYTES` over the sandbox's stream, at most
        :data:`DEPTH` in flight, each written through the slot's own view with its
        credentials; the whole file's SHA-256 is compared on both ends at the end.

        Args:
            slot: a held slot.
            local: a path (``str``/``PathLike``: a file, or a directory: its files and
                empty directories, links left out), ``bytes``, or a binary file object.
            remote_path: where in the slot (relative: to its workspace); parents are made.
            offset: resume: the slot's file already holds the first ``offset`` bytes of
                ``local`` (checked by checksum); only the rest is sent.

        Returns:
            A :class:`Transfer` (bytes moved, size, SHA-256, seconds).

        Raises:
            TransferError: a chunk failed, the resume point does not match, or the
                checksums differ.
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

        Streamed as :meth:`upload`, read through the slot's own view; a directory's
        entries are written only below ``local`` (names with ``..`` are left out).

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
            TransferError: the slot's file cannot be read, or the checksums differ (the
                file changed during the download).
            UsageError: bad arguments, a local path that cannot be written, a slot not held.
        """
        self._check_open()  # type: ignore[attr-defined]
        from . import tracing

        with tracing.span("download", {"slot_id": getattr(slot, "slot_id", None), "path": remote_path,
                                       "offset": offset}) as span:
            done = await download(self, slot, remote_path, local, offset)  # type: ignore[arg-type]
            tracing.set_attributes(span, {"bytes": done.bytes, "files": done.files, "sha256": done.sha256})
            return done
