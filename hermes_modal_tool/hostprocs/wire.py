"""What a split backend and its host processes say to each other (``host_processes=K``).

Frames are length-prefixed pickles on a Unix socket pair: both ends are this package,
run by the same user from the same interpreter, and nothing else holds the sockets
(the pair is made before the host process starts and passed to it alone), so a frame is
trusted as the process's own memory is.

A request is ``(rid, op, payload)``; an answer ``(rid, kind, value)`` with ``kind``
``ok`` / ``err`` (the last frame of a request), ``item`` (one piece of a stream,
answered with a ``credit``) or ``event`` (an :class:`~hermes_modal_tool.slots.OutputEvent`
of a running batch). Objects that live in one host process cross as references: a slot
as its lease id (:class:`SlotRef`), a snapshot as its id, a preview as its slot and port;
what comes back is a view of their public fields.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import socket
import struct
from dataclasses import dataclass
from typing import Any

from ..slots import ExecutionResult, Slot, SlotState

_HEADER = struct.Struct(">I")

#: Put in a stream's queue after its last piece.
END = object()

#: How many stream pieces (export chunks, import chunks) may be on the way unanswered.
STREAM_CREDIT = 8


def frame(obj: Any) -> bytes:
    """``obj`` as one frame (4-byte big-endian length, then its pickle)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame's object. Raises ``asyncio.IncompleteReadError`` at the end."""
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return pickle.loads(await reader.readexactly(size))


def recv_frame(sock: socket.socket) -> Any:
    """The next frame's object from a blocking socket (its timeout applies to each read).

    Raises:
        EOFError: the socket ended first. OSError: as ``sock.recv`` (a timeout among them).
    """
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    return pickle.loads(_recv_exactly(sock, size))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    parts = []
    while n:
        part = sock.recv(n)
        if not part:
            raise EOFError("the host process closed its socket")
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


@dataclass(frozen=True)
class SlotRef:
    """A slot, as the host process holding it knows it (its lease id)."""

    lease_id: str
    slot_id: str
    profile: str


@dataclass(frozen=True)
class SnapRef:
    """A snapshot held by a host process."""

    snapshot_id: str


@dataclass(frozen=True)
class PreviewRef:
    """An exposed port of a slot."""

    slot_id: str
    port: int
    url: str


@dataclass(frozen=True)
class ChunksRef:
    """An import's data, sent as ``chunk`` frames after the request (None: the end)."""


@dataclass(frozen=True)
class View:
    """Public fields of an object that stays in its host process: ``kind`` is ``slot``,
    ``snapshot`` or ``preview``."""

    kind: str
    fields: dict[str, Any]


_SLOT_FIELDS = ("slot_id", "workspace_dir", "trajectory_id", "sandbox_id", "profile", "index",
                "error", "acquired_at", "lease_id")


def slot_view(slot: Slot) -> View:
    """A slot's public fields (``state`` as its value)."""
    fields = {name: getattr(slot, name) for name in _SLOT_FIELDS}
    fields["state"] = slot.state.value
    return View("slot", fields)


def apply_slot_view(slot: Slot, view: View) -> Slot:
    """Copy a slot view's fields onto ``slot`` (the caller's object); returns it."""
    for name in _SLOT_FIELDS:
        setattr(slot, name, view.fields[name])
    slot.state = SlotState(view.fields["state"])
    return slot


def public_fields(obj: Any) -> dict[str, Any]:
    """A dataclass's fields whose names do not start with ``_``."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if not f.name.startswith("_")}


def result_tuple(r: ExecutionResult) -> tuple:
    """An :class:`ExecutionResult` as the tuple of its fields (a third of its pickle)."""
    return (r.success, r.output, r.error, r.execution_id, r.slot_id, r.metadata, r.stdout, r.stderr)


class HostProcessGone(Exception):
    """The host process answering a request exited before it answered."""
