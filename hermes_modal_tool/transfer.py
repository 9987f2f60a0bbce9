"""Snapshots as tar streams between sandboxes, machines and drivers (the host's side).

The agent writes and reads the stream (see ``hermes_modal_tool/agent/state/transfer.py`` for
the format); the host moves it in chunks, one request each, so neither side holds a
whole snapshot in memory. :func:`copy_between` moves a snapshot from one sandbox to
another chunk by chunk (export and import overlap).
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from .errors import SnapshotError, UsageError

if TYPE_CHECKING:
    from .sandbox import Sandbox

#: Bytes per chunk (before base64; a frame carries one).
CHUNK_BYTES = 4 * 1024 * 1024
CHUNK_WAIT_S = 300.0


class _Asks(Protocol):
    """What a transfer needs of :class:`~.snapshots.Snapshots` (named here, so this module
    does not import snapshots back): one request to a sandbox's agent, its reply checked."""

    async def ask(self, sb: Sandbox, message: dict[str, Any], what: str,
                  wait_s: float = ...) -> dict[str, Any]: ...


async def export_chunks(snaps: _Asks, sb: Sandbox, agent_id: str) -> AsyncIterator[bytes]:
    """The tar stream of snapshot ``agent_id`` of sandbox ``sb``, in chunks."""
    what = f"export of {agent_id} from {sb.sandbox_id}"
    started = await snaps.ask(sb, {"op": "export_snapshot", "snapshot": agent_id}, what)
    stream = started["stream"]
    while True:
        got = await snaps.ask(sb, {"op": "export_snapshot", "stream": stream, "max_bytes": CHUNK_BYTES},
                              what, CHUNK_WAIT_S)
        data = base64.b64decode(got["data"])
        if data:
            yield data
        if got["eof"]:
            return


async def import_chunks(snaps: _Asks, sb: Sandbox,
                        chunks: AsyncIterable[bytes] | Iterable[bytes] | bytes) -> dict[str, Any]:
    """Send a tar stream to sandbox ``sb``; return the agent's reply (``snapshot`` id,
    ``size_bytes``)."""
    what = f"import into {sb.sandbox_id}"
    started = await snaps.ask(sb, {"op": "import_snapshot"}, what)
    stream = started["stream"]
    try:
        async for chunk in import_pieces(chunks):
            await _send(snaps, sb, stream, chunk, what)
    finally:
        end = await snaps.ask(sb, {"op": "import_snapshot", "stream": stream, "end": True}, what,
                              CHUNK_WAIT_S)
    return end


async def import_pieces(data: Any) -> AsyncIterator[bytes | bytearray | memoryview]:
    """``import_snapshot``'s data as pieces: bytes cut into :data:`CHUNK_BYTES`, or each
    chunk of an iterable or async iterable of bytes (``import_chunks``, and a split
    backend's router before it sends them to a host process).

    Raises:
        UsageError: ``data`` is none of those, or a chunk is not bytes (as it comes).
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        for i in range(0, len(view), CHUNK_BYTES):
            yield view[i:i + CHUNK_BYTES]
        return
    if isinstance(data, AsyncIterable):
        async for chunk in data:
            yield _checked(chunk)
    elif isinstance(data, Iterable):
        for chunk in data:
            yield _checked(chunk)
    else:
        raise UsageError(f"import_snapshot takes bytes or an (async) iterable of bytes, "
                         f"got {type(data).__name__}")


def _checked(chunk: Any) -> bytes | bytearray | memoryview:
    if not isinstance(chunk, (bytes, bytearray, memoryview)):
        raise UsageError(f"import_snapshot: each chunk must be bytes, got {type(chunk).__name__}")
    return chunk


async def _send(snaps: _Asks, sb: Sandbox, stream: str, chunk: bytes | bytearray | memoryview,
                what: str) -> None:
    for i in range(0, len(chunk), CHUNK_BYTES):
        await snaps.ask(sb, {"op": "import_snapshot", "stream": stream,
                             "data": base64.b64encode(chunk[i:i + CHUNK_BYTES]).decode("ascii")},
                        what, CHUNK_WAIT_S)


async def copy_between(snaps: _Asks, source: Sandbox, agent_id: str, target: Sandbox,
                       cap_bytes: int) -> str:
    """Move snapshot ``agent_id`` of ``source`` to ``target``; return its id there.

    Raises:
        SnapshotError: either side failed, or the copy would pass ``target``'s cap.
    """
    listing = await snaps.ask(target, {"op": "snapshots"}, f"snapshots of {target.sandbox_id}")
    have = await snaps.ask(source, {"op": "snapshots"}, f"snapshots of {source.sandbox_id}")
    size = sum(s["size_bytes"] for s in have["snapshots"] if s["snapshot"] == agent_id)
    if listing["total_bytes"] + size > cap_bytes:
        raise SnapshotError(f"copying {agent_id} ({size / 2**20:.1f} MiB) to {target.sandbox_id} would "
                            f"pass its snapshot_disk cap ({cap_bytes / 2**20:.0f} MiB)")
    reply = await import_chunks(snaps, target, export_chunks(snaps, source, agent_id))
    return str(reply["snapshot"])
