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
    if isinstance(chunks, (bytes, bytearray, memoryview)):
        data = bytes(chunks)
        chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
    try:
        if hasattr(chunks, "__aiter__"):
            async for chunk in chunks:  # type: ignore[union-attr]
                await _send(snaps, sb, stream, chunk, what)
        elif isinstance(chunks, Iterable):
            for chunk in chunks:
                await _send(snaps, sb, stream, chunk, what)
        else:
            raise UsageError(f"import_snapshot takes bytes or an (async) iterable of bytes, "
                             f"got {type(chunks).__name__}")
    finally:
        end = await snaps.ask(sb, {"op": "import_snapshot", "stream": stream, "end": True}, what,
                              CHUNK_WAIT_S)
    return end


async def _send(snaps: _Asks, sb: Sandbox, stream: str, chunk: bytes, what: str) -> None:
    if not isinstance(chunk, (bytes, bytearray, memoryview)):
        raise UsageError(f"import_snapshot: each chunk must be bytes, got {type(chunk).__name__}")
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
