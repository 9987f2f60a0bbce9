"""The router's end of one host process (see ``worker.py`` for the other end)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import SandboxStartError
from . import wire

log = logging.getLogger("hermes_modal_tool")

#: Seconds ``get_status`` waits for a host process's status before reporting it missing.
STATUS_WAIT_S = 5.0
#: Seconds a host process has to stop its sandboxes and exit before it is killed.
STOP_WAIT_S = 60.0
#: A replacement host process that exits sooner than this after it started is not
#: replaced again (a crash at start would otherwise be restarted over and over).
SHORTEST_LIFE_S = 10.0
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class HostProc:
    """One host process: its requests in flight and what it holds.

    Attributes:
        index: its place (0..K-1); a replacement takes the place of the one that exited.
        serial: its sandbox and snapshot ids carry ``h{serial}.`` (unique in the backend).
        shares: profile name -> ``(min_sandboxes, max_sandboxes)`` it owns.
        held: profile name -> slots it has leased out now.
        alive: False once it exited (``died`` says why).
    """

    def __init__(self, index: int, shares: dict[str, tuple[int, int]], serial: int | None = None,
                 on_lost: Callable[[HostProc], None] | None = None) -> None:
        self.index = index
        self.serial = index if serial is None else serial  # its ids carry "h{serial}."
        self.shares = shares
        self.on_lost = on_lost
        self.held: dict[str, int] = dict.fromkeys(shares, 0)
        self.alive = False
        self.ready_at: float | None = None  # time.monotonic() when it accepted its settings
        self.died: str | None = None
        self.pid = 0
        self._status_lock = threading.Lock()  # get_status may be called from other threads
        self._rids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._events: dict[int, Callable[[Any], None]] = {}
        self._items: dict[int, asyncio.Queue] = {}
        self._credits: dict[int, asyncio.Semaphore] = {}
        self._proc: subprocess.Popen | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._status: socket.socket | None = None
        self._pump: asyncio.Task | None = None

    def __repr__(self) -> str:
        return f"<host process {self.index} pid {self.pid}{'' if self.alive else ' (exited)'}>"

    async def start(self, init: dict[str, Any]) -> None:
        """Start the process, hand it its backend's settings (``init``), wait for its answer.

        Raises:
            SandboxStartError: it did not start or refused the settings.
        """
        ours, theirs = socket.socketpair()
        status_ours, status_theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        try:
            self._proc = await asyncio.to_thread(
                subprocess.Popen, [sys.executable, "-m", "hermes_modal_tool.hostprocs.worker", str(theirs.fileno()),
                 str(status_theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(), status_theirs.fileno()), env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
            status_theirs.close()
        self.pid = self._proc.pid
        self._status = status_ours
        reader, self._writer = await asyncio.open_unix_connection(sock=ours)
        self.alive = True
        self._pump = asyncio.create_task(self._read(reader), name=f"hmt-host-{self.index}")
        try:
            await self.request("init", {**init, "index": self.serial})
            self.ready_at = time.monotonic()
        except BaseException as exc:
            await self.close(kill=True)
            raise SandboxStartError(f"host process {self.index} did not start: {exc}") from exc

    def send(self, rid: int, op: str, payload: Any) -> None:
        """Queue one frame to the process (nothing is sent once it exited)."""
        if self.alive and self._writer is not None:
            self._writer.write(wire.frame((rid, op, payload)))

    def request(self, op: str, payload: Any, on_event: Callable[[Any], None] | None = None,
                items: asyncio.Queue | None = None) -> asyncio.Future:
        """Send a request; the future gets its answer (or :class:`~.wire.HostProcessGone`).
        ``on_event`` is called with each event; stream pieces go to ``items``."""
        fut = asyncio.get_running_loop().create_future()
        if not self.alive:
            fut.set_exception(wire.HostProcessGone(self.gone()))
            return fut
        rid = next(self._rids)
        fut.rid = rid  # type: ignore[attr-defined]
        self._pending[rid] = fut
        if on_event is not None:
            self._events[rid] = on_event
        if items is not None:
            self._items[rid] = items
        self.send(rid, op, payload)
        return fut

    def cancel(self, fut: asyncio.Future) -> None:
        """Cancel a request's work in the process (its answer is dropped)."""
        rid = getattr(fut, "rid", None)
        if rid is not None and self._pending.pop(rid, None) is not None:
            self._events.pop(rid, None)
            self._items.pop(rid, None)
            self.send(0, "cancel", rid)

    def gone(self) -> str:
        return f"host process {self.index} (pid {self.pid}) exited: {self.died or 'unknown'}"

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                rid, kind, value = await wire.read_frame(reader)
                if kind == "event":
                    listen = self._events.get(rid)
                    if listen is not None:
                        listen(value)
                elif kind == "item":
                    queue = self._items.get(rid)
                    if queue is not None:
                        queue.put_nowait(value)
                elif kind == "credit":
                    credit = self._credits.get(rid)
                    if credit is not None:
                        credit.release()
                else:
                    self._events.pop(rid, None)
                    credit = self._credits.pop(rid, None)
                    if credit is not None:  # a sender waiting for room sees the answer
                        credit.release()
                    queue = self._items.pop(rid, None)
                    if queue is not None:
                        queue.put_nowait(wire.END)
                    fut = self._pending.pop(rid, None)
                    if fut is not None and not fut.done():
                        if kind == "ok":
                            fut.set_result(value)
                        else:
                            fut.set_exception(value)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self.died = self.died or f"its connection ended ({type(exc).__name__})"
        except Exception as exc:  # noqa: BLE001 - a frame that does not decode ends the process's use
            self.died = f"a frame that does not decode ({type(exc).__name__}: {exc})"
            log.error("host process %d: %s", self.index, self.died)
        finally:
            self._lost()

    def _lost(self) -> None:
        self.alive = False
        if self._proc is not None and self._proc.poll() is not None and not self.died:
            self.died = f"exit status {self._proc.returncode}"
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(wire.HostProcessGone(self.gone()))
        for queue in self._items.values():
            queue.put_nowait(wire.HostProcessGone(self.gone()))
        for credit in self._credits.values():
            credit.release()
        self._credits.clear()
        self._events.clear()
        self._items.clear()
        if self.on_lost is not None and self.ready_at is not None:
            replacement = self.serial != self.index
            if not replacement or time.monotonic() - self.ready_at >= SHORTEST_LIFE_S:
                self.on_lost(self)
            else:
                log.error("%s within %.0f s of its start: not replaced", self.gone(), SHORTEST_LIFE_S)

    def credit_for(self, rid: int) -> asyncio.Semaphore:
        """Flow control of an upload stream: a permit per piece the process may still take."""
        sem = self._credits[rid] = asyncio.Semaphore(wire.STREAM_CREDIT)
        return sem

    def status(self) -> dict[str, Any] | None:
        """The process's ``get_status()`` (None: exited or no answer within STATUS_WAIT_S).

        Blocks the caller up to STATUS_WAIT_S (``get_status`` is synchronous)."""
        with self._status_lock:
            return self._ask_status()

    def _ask_status(self) -> dict[str, Any] | None:
        sock = self._status
        if not self.alive or sock is None:
            return None
        try:
            sock.settimeout(STATUS_WAIT_S)
            sock.sendall(b"s")
            return wire.recv_frame(sock)  # type: ignore[no-any-return]
        except (OSError, EOFError) as exc:  # a frame half read: the socket is of no more use
            log.warning("host process %d: no status (%s)", self.index, exc)
            sock.close()
            self._status = None
            return None

    async def close(self, kill: bool = False) -> None:
        """End the process: close its socket (it stops its backend and exits), wait up to
        STOP_WAIT_S, then kill it."""
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        proc = self._proc
        if proc is not None:
            if kill:
                proc.kill()
            try:
                await asyncio.to_thread(proc.wait, STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                log.error("host process %d did not stop within %.0f s: killed", self.index, STOP_WAIT_S)
                proc.kill()
                await asyncio.to_thread(proc.wait)
        if self._pump is not None:
            await asyncio.gather(self._pump, return_exceptions=True)
        if self._status is not None:
            self._status.close()
        self.alive = False
