"""Resumed directory transfers (``backend.upload(..., resume=True)``, ``backend.download(...,
resume=True)``; see :mod:`.filetransfer`).

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
