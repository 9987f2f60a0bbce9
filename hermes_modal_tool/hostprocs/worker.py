"""One host process of a split backend (``ToolBackend(..., host_processes=K)``).

Started by :mod:`hermes_modal_tool.hostprocs.router` as ``python -m
hermes_modal_tool.hostprocs.worker REQUESTS_FD STATUS_FD``. It runs an ordinary
:class:`~hermes_modal_tool.backend.ToolBackend` over its share of each profile's
sandboxes, on its own event loop, and answers the router's requests (``wire.py``) on
the first socket; the second answers ``get_status`` (which is synchronous) from a
thread. It dies with the router: ``PR_SET_PDEATHSIG`` (SIGKILL) when the router's
process ends, and a clean ``stop()`` of its backend when the request socket closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import pickle
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

from .. import loops
from ..backend import ToolBackend
from ..errors import HermesModalToolError, SandboxError, UsageError
from ..previews import Preview
from ..sandbox_images import use_image
from ..slots import Slot
from ..snapshots import SlotSnapshot
from . import wire

#: Methods the router may call by name (the rest of the API is built on these).
CALLS = frozenset({
    "start", "stop", "acquire", "release", "usage", "snapshot", "fork", "setup_snapshot",
    "import_snapshot", "export_snapshot", "release_snapshot", "snapshot_sandbox", "upload",
    "download", "expose", "unexpose", "_process_request", "use_image"})


class HostProcess:
    """The serving side: requests in, answers out, on one event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.backend: ToolBackend | None = None
        self.slots: dict[str, Slot] = {}  # lease id -> slot
        self.snaps: dict[str, SlotSnapshot] = {}
        self.released: set[str] = set()  # ids of snapshots released here
        self.previews: list[Preview] = []
        self.tasks: dict[int, asyncio.Task] = {}
        self.credits: dict[int, asyncio.Semaphore] = {}
        self.chunks: dict[int, asyncio.Queue] = {}

    def send(self, message: tuple) -> None:
        self.writer.write(wire.frame(message))

    async def serve(self) -> None:
        rid, _op, init = await wire.read_frame(self.reader)
        index = init.pop("index")
        try:
            self.backend = ToolBackend(**init, host_processes=1)
        except Exception as exc:  # noqa: BLE001 - refused settings go back to the router
            self.send((rid, "err", _portable(exc)))
            return
        self.backend._id_tag = f"h{index}."
        self.send((rid, "ok", os.getpid()))
        while True:
            try:
                rid, op, payload = await wire.read_frame(self.reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            if op == "cancel":
                task = self.tasks.get(payload)
                if task is not None:
                    task.cancel()
            elif op == "credit":
                credit = self.credits.get(payload)
                if credit is not None:
                    credit.release()
            elif op == "chunk":
                self.chunks[payload[0]].put_nowait(payload[1])
            else:
                if op == "call" and payload[0] == "import_snapshot":
                    self.chunks[rid] = asyncio.Queue()
                self.tasks[rid] = asyncio.create_task(self.answer(rid, op, payload))
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await self.backend.stop()
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()

    async def answer(self, rid: int, op: str, payload: Any) -> None:
        try:
            if op == "batch":
                value: Any = await self.batch(rid, *payload)
            else:
                value = await self.call(rid, *payload)
            self.send((rid, "ok", value))
        except asyncio.CancelledError:  # the router's cancel (it no longer waits), or stop
            self.send((rid, "err", SandboxError("the call was cancelled in its host process")))
        except BaseException as exc:  # every failure goes back to the router's caller
            self.send((rid, "err", _portable(exc)))
        finally:
            self.tasks.pop(rid, None)
            self.credits.pop(rid, None)
            self.chunks.pop(rid, None)
        with contextlib.suppress(ConnectionError):  # the router is gone: nobody to answer
            await self.writer.drain()

    async def batch(self, rid: int, items: list[tuple], timeout_s: float | None, events: bool) -> list[tuple]:
        assert self.backend is not None
        requests = [(self.slot(*ref), tool, args) for ref, tool, args in items]
        on_output = (lambda event: self.send((rid, "event", event))) if events else None
        results = await self.backend.execute_batch(requests, timeout_s, on_output)
        return [wire.result_tuple(r) for r in results]

    async def call(self, rid: int, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        assert self.backend is not None
        if method not in CALLS:
            raise UsageError(f"host process: no method {method!r}")
        args = tuple(self.resolve(rid, a) for a in args)
        if method == "use_image":
            if args[0] in self.backend.profiles:  # a profile this process has a share of
                use_image(self.backend, *args)
            return None, []
        if method == "export_snapshot":
            return await self.stream(rid, self.backend.export_snapshot(args[0]))
        value = await getattr(self.backend, method)(*args, **kwargs)
        slots = [a for a in args if isinstance(a, Slot)]
        if method == "release":
            for slot in slots:
                self.slots.pop(slot.lease_id, None)
        if method == "release_snapshot":
            self.snaps.pop(args[0].snapshot_id, None)
            self.released.add(args[0].snapshot_id)
        return self.pack(value), [wire.slot_view(s) for s in slots]

    async def stream(self, rid: int, items: AsyncIterator[bytes]) -> None:
        credit = self.credits[rid] = asyncio.Semaphore(wire.STREAM_CREDIT)
        async for item in items:
            await credit.acquire()
            self.send((rid, "item", item))
            await self.writer.drain()

    async def chunks_of(self, rid: int) -> AsyncIterator[bytes]:
        queue = self.chunks[rid]
        while True:
            piece = await queue.get()
            if piece is None:
                return
            self.send((rid, "credit", None))
            yield piece

    def slot(self, lease_id: str, slot_id: str, profile: str) -> Slot:
        found = self.slots.get(lease_id)
        # A lease this process does not hold: a stand-in its backend refuses as not held.
        return found if found is not None else Slot(slot_id, "", profile=profile)

    def resolve(self, rid: int, arg: Any) -> Any:
        if isinstance(arg, wire.SlotRef):
            return self.slot(arg.lease_id, arg.slot_id, arg.profile)
        if isinstance(arg, wire.SnapRef):
            snap = self.snaps.get(arg.snapshot_id)
            if snap is None and arg.snapshot_id in self.released:
                raise UsageError(f"snapshot {arg.snapshot_id} was released; take a new one")
            if snap is None:
                raise UsageError(f"snapshot {arg.snapshot_id} does not belong to this backend")
            return snap
        if isinstance(arg, wire.PreviewRef):
            for p in self.previews:
                if (p.slot_id, p.port, p.url) == (arg.slot_id, arg.port, arg.url):
                    return p
            raise UsageError(f"no preview of port {arg.port} of slot {arg.slot_id} in this backend")
        if isinstance(arg, wire.ChunksRef):
            return self.chunks_of(rid)
        return arg

    def pack(self, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], Slot):
            return [self.pack(v) for v in value]
        if isinstance(value, Slot):
            self.slots[value.lease_id] = value
            return wire.slot_view(value)
        if isinstance(value, SlotSnapshot):
            self.snaps[value.snapshot_id] = value
            return wire.View("snapshot", wire.public_fields(value))
        if isinstance(value, Preview):
            self.previews = [p for p in self.previews if not p.revoked] + [value]
            return wire.View("preview", wire.public_fields(value))
        return value


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle round trip, else a HermesModalToolError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return HermesModalToolError(f"{type(exc).__name__}: {exc}")


def _serve_status(sock: socket.socket, server: HostProcess, loop: asyncio.AbstractEventLoop) -> None:
    """The status socket: one byte in, the backend's ``get_status()`` out (a frame)."""

    async def status() -> Any:
        return server.backend.get_status() if server.backend is not None else {}

    while sock.recv(1):
        try:
            answer = asyncio.run_coroutine_threadsafe(status(), loop).result(10)
        except Exception as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sock.sendall(wire.frame(answer))


async def _main(requests_fd: int, status_fd: int) -> None:
    sock = socket.socket(fileno=requests_fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    server = HostProcess(reader, writer)
    status = socket.socket(fileno=status_fd)
    threading.Thread(target=_serve_status, args=(status, server, asyncio.get_running_loop()),
                     name="hmt-host-status", daemon=True).start()
    await server.serve()
    writer.close()


def main(argv: list[str]) -> None:
    """Serve until the router closes the request socket (``argv``: the two socket fds and
    the router's pid)."""
    parent = int(argv[3])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    libc.prctl(15, b"hmt-host")  # PR_SET_NAME: what ps and /proc/PID/comm show
    if os.getppid() != parent:  # the router ended before the line above took effect
        sys.exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the router's to handle
    loops.run(_main(int(argv[1]), int(argv[2])))


if __name__ == "__main__":
    main(sys.argv)
