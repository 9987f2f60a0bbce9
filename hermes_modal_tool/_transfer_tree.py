"""Directories as tar streams, the host's end (see :mod:`.filetransfer`): a local directory
packed in a worker thread and sent as an upload stream; a slot's directory received and
unpacked beneath the local directory's descriptor in a worker thread
(``agent/files/tarstream.py``, the code the agent runs), the stream treated as hostile.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import queue
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ._transfer_wire import (
    CHUNK_BYTES,
    DEPTH,
    Transfer,
    _ask,
    _close,
    _count,
    _receive,
    _send,
    _where,
)
from .agent.files import tarstream
from .errors import TransferError, UsageError
from .slots import Slot

if TYPE_CHECKING:
    from ._backend_view import BackendView
    from .sandbox import Sandbox


async def _tar_chunks(top: str, counts: list[int], digest: hashlib._Hash,
                      skip: set[str] | None = None) -> AsyncIterator[bytes]:
    """Local directory ``top`` as a tar stream in chunks, packed in a worker thread (at most
    two chunks ahead); ``counts`` gets ``[files, bytes, skipped]``; ``skip``: relative
    names of files left out (a resume's)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=2)
    stop: list[bool] = []

    def put(item: bytes | None) -> None:
        if not stop:
            asyncio.run_coroutine_threadsafe(ready.put(item), loop).result()

    class Out:
        buf = bytearray()
        told = False

        def write(self, data: bytes) -> int:
            self.buf += data
            while len(self.buf) >= CHUNK_BYTES and not stop:
                chunk = bytes(self.buf[:CHUNK_BYTES])
                del self.buf[:CHUNK_BYTES]
                digest.update(chunk)
                put(chunk)
            if stop and not self.told:
                self.told = True  # once: tarfile's own close() writes again as it is dropped
                raise TransferError("the upload stopped")
            return len(data)

    def work() -> None:
        out = Out()
        try:
            try:
                fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as exc:
                raise UsageError(f"cannot read {top!r}: {exc.strerror}") from None
            try:
                counts[:] = tarstream.pack(fd, out, skip=skip)
            finally:
                os.close(fd)
            if out.buf:
                digest.update(bytes(out.buf))
                put(bytes(out.buf))
        finally:
            put(None)  # the end, or the error (raised by ``await packing``)

    packing = loop.run_in_executor(None, work)
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
        if not packing.cancelled() and packing.exception() is not None:
            pass  # raised above, or the consumer stopped first (its own error is the one)


async def upload_tree(backend: BackendView, slot: Slot, top: str, remote: str,
                      skip: set[str] | None = None) -> Transfer:
    """Local directory ``top`` to the slot's ``remote``, as one tar stream; ``skip``:
    relative names of files left out (a resume's)."""
    started = time.monotonic()
    counts = [0, 0, 0]
    digest = hashlib.sha256()
    there = await upload_tar_stream(backend, slot, _tar_chunks(top, counts, digest, skip), remote,
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


async def download_tree(backend: BackendView, slot: Slot, remote: str, top: str,
                         opened: tuple[Sandbox, dict[str, Any], str]) -> Transfer:
    """The slot's directory stream ``opened`` unpacked beneath local directory ``top``."""
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

    received = False
    try:
        there = await _receive(sb, info["stream"], feed, what)
        received = True
    finally:
        await asyncio.to_thread(reader.items.put, None)
        try:
            made, size = await unpacking
        except tarstream.TarRefused as exc:
            if received:  # else the stream's own error is the one raised (the tar was cut short)
                raise TransferError(f"{remote}: the slot's tar stream was refused: {exc}; nothing was "
                                    f"written outside {top}") from None
        except OSError as exc:
            if received:
                raise TransferError(f"{remote}: cannot write below {top}: {exc}") from None
    if there["sha256"] != digest.hexdigest() or there["files"] != made:
        raise TransferError(f"{remote}: the tar stream differs after the download (slot: {there['files']} "
                            f"files, sha256 {there['sha256']}; host: {made} files, {digest.hexdigest()})")
    return Transfer(remote, size, size, made, None, time.monotonic() - started, int(there.get("skipped", 0)))


