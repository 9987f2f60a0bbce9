"""Resumed transfers (``backend.upload(..., resume=True)``, ``backend.download(...,
resume=True)``; see :mod:`.filetransfer`): a directory's, as below; a single file's by the
slot's ``checksum`` (its size and SHA-256, and that of its first bytes) compared with the
local file's (:func:`upload_file_resumed`, :func:`download_resumed`).

Both ends list the directory's regular files with their size, mode and SHA-256
(``agent/files/treesums.py``: the agent on the slot's directory, in a download stream of
``kind: "manifest"`` with the slot's credentials; the host on its own in a worker thread).
Each file of the sending side is then

- *kept*: the receiving side has it with the same size, SHA-256 and mode: not sent;
- *continued*: the receiving side holds a shorter file whose bytes are the sender's first
  ones (compared by SHA-256; what an interrupted transfer leaves): the rest is sent from
  that offset as a resumed file transfer (checksummed whole at the end), then given the
  sender's mode and mtime;
- *sent*: anything else (missing, different, or a file with several names: hard links
  go in the tar stream, so they arrive as links), in one tar stream as a plain transfer
  sends it, checked the same way.

Entries that are not regular files (directories, links) always go in the tar stream.
Nothing on the receiving side is deleted. The host holds one entry per listed file (the
remote manifest); the agent holds the host's list of names for the time of the stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._transfer_tree import download_tree, upload_tree
from ._transfer_wire import Transfer, _ask, _close, _count, _receive, _where
from .agent.files import tarstream, treesums
from .errors import TransferError, UsageError
from .slots import Slot

if TYPE_CHECKING:
    from .sandbox import Sandbox

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@dataclass
class Plan:
    """What a resume sends: ``leave_out`` (names not in the tar stream: kept and
    continued), ``continued`` as ``(name, offset, mode, mtime)``, and the kept files'
    count and bytes."""

    leave_out: set[str] = field(default_factory=set)
    continued: list[tuple[str, int, int, int]] = field(default_factory=list)
    kept: int = 0
    kept_bytes: int = 0


def decide(plan: Plan, rel: str, mine: dict[str, Any], theirs: dict[str, Any] | None,
           their_head: str | None) -> None:
    """Add file ``rel`` of the sending side (``mine``: a manifest line) to ``plan``, given
    the receiving side's line (``theirs``) and the SHA-256 of the sender's first
    ``theirs["s"]`` bytes (``their_head``, when the receiver's file is shorter)."""
    if theirs is None or mine["n"] > 1 or theirs.get("n", 1) > 1:
        return
    if theirs["s"] == mine["s"] and theirs["h"] == mine["h"] and theirs["m"] == mine["m"]:
        plan.leave_out.add(rel)
        plan.kept += 1
        plan.kept_bytes += mine["s"]
    elif theirs["s"] < mine["s"] and their_head is not None and their_head == theirs["h"]:
        plan.leave_out.add(rel)
        plan.continued.append((rel, theirs["s"], mine["m"], mine["t"]))


async def _remote_manifest(sb: Sandbox, index: int, remote: str, prefixes: dict[str, int],
                           what: str) -> dict[str, dict[str, Any]]:
    """The slot's directory ``remote``'s manifest by name (empty when it does not exist);
    ``prefixes``: {name: size} whose prefix sums are wanted."""
    listing = b"".join((json.dumps([rel, n]) + "\n").encode("ascii") for rel, n in prefixes.items())
    opened = await _ask(sb, {"op": "download", "slot": index, "path": remote, "kind": "manifest",
                             "blob": listing}, what)
    entries: dict[str, dict[str, Any]] = {}
    rest = bytearray()

    def sink(blob: bytes) -> None:
        rest.extend(blob)
        cut = rest.rfind(b"\n") + 1
        if cut:
            for line in bytes(rest[:cut]).splitlines():
                item = json.loads(line.decode("ascii"))
                entries[item["p"]] = item
            del rest[:cut]

    there = await _receive(sb, opened["stream"], sink, what)
    if rest or there.get("files") != len(entries):
        raise TransferError(f"{what}: the slot's list of files came back incomplete "
                            f"({len(entries)} of {there.get('files')})")
    return entries


def _local_manifest(top: str, prefixes: dict[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """The local directory ``top``'s manifest by name (every regular file hashed)."""
    fd = os.open(top, _DIR)
    try:
        out: dict[str, dict[str, Any]] = {}
        for rel, dfd, name, st in treesums.files_below(fd):
            want = (prefixes or {}).get(rel)
            sums = treesums.file_sums(dfd, name, st, want if want is not None and want < st.st_size else None)
            if sums is not None:
                out[rel] = treesums.entry(rel, st, sums)
        return out
    finally:
        os.close(fd)


def _local_sizes(top: str) -> dict[str, int]:
    fd = os.open(top, _DIR)
    try:
        return {rel: st.st_size for rel, _dfd, _name, st in treesums.files_below(fd)}
    finally:
        os.close(fd)


def _join(remote: str, rel: str) -> str:
    return remote.rstrip("/") + "/" + rel if remote.rstrip("/") else rel


async def upload_tree_resumed(backend: Any, slot: Slot, top: str, remote: str,
                              upload_file: Callable[..., Awaitable[Transfer]]) -> Transfer:
    """Local directory ``top`` to the slot's ``remote``, sending only what the slot lacks;
    ``upload_file``: :func:`.filetransfer.upload_file` (a file continued from an offset)."""
    started = time.monotonic()
    sb, index = _where(backend, slot)
    what = f"{remote}: resumed upload of directory {top} into slot {slot.slot_id}"
    theirs = await _remote_manifest(sb, index, remote, {}, what)
    prefixes = {rel: line["s"] for rel, line in theirs.items()}
    try:
        mine = await asyncio.to_thread(_local_manifest, top, prefixes)
    except OSError as exc:
        raise UsageError(f"cannot read {top!r}: {exc.strerror}") from None
    plan = Plan()
    for rel, line in mine.items():
        decide(plan, rel, line, theirs.get(rel), line.get("ph"))
    sent = await upload_tree(backend, slot, top, remote, plan.leave_out)
    moved, size = sent.bytes, sent.size + plan.kept_bytes
    for rel, offset, mode, mtime in plan.continued:
        fh = await asyncio.to_thread(open, os.path.join(top, rel), "rb")
        with fh:
            fh.seek(0)
            rest = await upload_file(backend, slot, fh, _join(remote, rel), offset, [mode, mtime])
        moved += rest.bytes
        size += rest.size
    return Transfer(remote, moved, size, sent.files + len(plan.continued), None, time.monotonic() - started,
                    sent.skipped, plan.kept)


async def download_tree_resumed(backend: Any, slot: Slot, remote: str, top: str,
                                download_file: Callable[..., Awaitable[Transfer]]) -> Transfer:
    """The slot's directory ``remote`` to local directory ``top``, fetching only what
    ``top`` lacks; ``download_file``: :func:`.filetransfer.download_file`."""
    started = time.monotonic()
    sb, index = _where(backend, slot)
    what = f"{remote}: resumed download of directory {remote} from slot {slot.slot_id}"
    try:
        await asyncio.to_thread(os.makedirs, top, exist_ok=True)
        sizes = await asyncio.to_thread(_local_sizes, top)
    except OSError as exc:
        raise UsageError(f"cannot write {top!r}: {exc.strerror}") from None
    theirs = await _remote_manifest(sb, index, remote, sizes, what)
    mine = await asyncio.to_thread(_local_manifest, top)
    plan = Plan()
    for rel, line in theirs.items():  # the slot sends: its lines are the sender's
        have = mine.get(rel)
        decide(plan, rel, line, have, line.get("ph") if have is not None else None)
    _count(slot, "download")
    listing = b"".join((json.dumps(rel) + "\n").encode("ascii") for rel in sorted(plan.leave_out))
    info = await _ask(sb, {"op": "download", "slot": index, "path": remote, "blob": listing}, what)
    if info["kind"] != "dir":
        await _close(sb, "download", info["stream"])
        raise TransferError(f"{what}: {remote} is no longer a directory")
    got = await download_tree(backend, slot, remote, top, (sb, info, what))
    moved, size = got.bytes, got.size + plan.kept_bytes
    for rel, offset, mode, mtime in plan.continued:
        fh = await asyncio.to_thread(_open_beneath, top, rel)
        with fh:
            fh.truncate(offset)
            fh.seek(offset)
            rest = await download_file(backend, slot, _join(remote, rel), fh, offset)
            await asyncio.to_thread(_set_meta, fh.fileno(), mode, mtime)
        moved += rest.bytes
        size += rest.size
    return Transfer(remote, moved, size, got.files + len(plan.continued), None, time.monotonic() - started,
                    got.skipped, plan.kept)


def _open_beneath(top: str, rel: str) -> Any:
    """Local file ``rel`` below ``top``, open for reading and writing, reached from
    ``top``'s descriptor without following a link (the slot's stream made the tree)."""
    fd = os.open(top, _DIR)
    tree = tarstream._FdTree(fd)
    try:
        parts = rel.split("/")
        parent = tree.parent(parts[:-1])
        file_fd = os.open(parts[-1], os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    finally:
        tree.close()
        os.close(fd)
    if not stat.S_ISREG(os.fstat(file_fd).st_mode):
        os.close(file_fd)
        raise TransferError(f"{os.path.join(top, rel)} is no longer a regular file")
    return os.fdopen(file_fd, "r+b")


def _set_meta(fd: int, mode: int, mtime: int) -> None:
    os.fchmod(fd, mode & 0o1777)
    os.utime(fd, (mtime, mtime))


# -- a single file: resume=True finds the offset itself ------------------------------------
def _sha_of(path: str, n: int | None = None) -> tuple[int, str]:
    """``(size, SHA-256 of the first n bytes, or of all)`` of local file ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        left = size if n is None else min(n, size)
        while left:
            piece = fh.read(min(left, 1 << 20))
            if not piece:
                break
            digest.update(piece)
            left -= len(piece)
    return size, digest.hexdigest()


async def _remote_sums(sb: Sandbox, index: int, remote: str, prefix: int | None, what: str
                       ) -> dict[str, Any] | None:
    """The slot's file's ``size``, ``sha256`` (and ``prefix_sha256``), None when it is missing."""
    ask: dict[str, Any] = {"op": "checksum", "slot": index, "path": remote}
    if prefix is not None:
        ask["prefix"] = prefix
    try:
        return await _ask(sb, ask, what)
    except TransferError as exc:
        if "no such file" in str(exc) or "no such directory" in str(exc):
            return None
        raise


async def upload_file_resumed(backend: Any, slot: Slot, path: str, remote: str,
                              upload: Callable[..., Awaitable[Transfer]]) -> Transfer:
    """Local file ``path`` to the slot's ``remote``: nothing when the slot's file is equal,
    the rest when it holds the local file's first bytes, else all of it. ``upload``:
    :func:`.filetransfer.upload`."""
    started = time.monotonic()
    sb, index = _where(backend, slot)
    what = f"{remote}: resumed upload of {path} into slot {slot.slot_id}"
    theirs = await _remote_sums(sb, index, remote, None, what)
    if theirs is not None:
        try:
            size, head = await asyncio.to_thread(_sha_of, path, theirs["size"])
        except OSError as exc:
            raise UsageError(f"cannot read {path!r}: {exc.strerror}") from None
        if theirs["size"] <= size and head == theirs["sha256"]:
            if theirs["size"] == size:
                return Transfer(remote, 0, size, 0, head, time.monotonic() - started, 0, 1)
            return await upload(backend, slot, path, remote, theirs["size"])
    return await upload(backend, slot, path, remote, 0)


async def download_resumed(backend: Any, slot: Slot, remote: str, top: str,
                           download: Callable[..., Awaitable[Transfer]],
                           download_file: Callable[..., Awaitable[Transfer]]) -> Transfer:
    """``download(..., resume=True)``: a slot's directory into local directory ``top``
    (:func:`download_tree_resumed`), or a slot's file into local file ``top``: nothing when
    equal, the rest when the local file holds its first bytes, else all of it."""
    started = time.monotonic()
    if await asyncio.to_thread(os.path.isdir, top):
        return await download_tree_resumed(backend, slot, remote, top, download_file)
    sb, index = _where(backend, slot)
    what = f"{remote}: resumed download from slot {slot.slot_id}"
    have = await asyncio.to_thread(lambda: os.stat(top).st_size if os.path.isfile(top) else None)
    try:
        theirs = await _ask(sb, {"op": "checksum", "slot": index, "path": remote,
                                 **({"prefix": have} if have is not None else {})}, what)
    except TransferError as exc:
        if str(exc).endswith("is a directory"):
            return await download_tree_resumed(backend, slot, remote, top, download_file)
        raise
    if have is not None and have <= theirs["size"]:
        size, mine = await asyncio.to_thread(_sha_of, top)
        if mine == (theirs["sha256"] if size == theirs["size"] else theirs.get("prefix_sha256")):
            if size == theirs["size"]:
                return Transfer(remote, 0, size, 0, mine, time.monotonic() - started, 0, 1)
            return await download(backend, slot, remote, top, size)
    return await download(backend, slot, remote, top, 0)
