"""One running sandbox as the host sees it: its agent's request/response multiplexer.

Every request is one frame on the shared stream; responses are matched by id.
When the stream closes (the agent died, the sandbox was killed) every pending
request fails at once with :class:`~hermes_modal_tool.errors.SandboxDiedError`.

Each request has a deadline (for a call: its timeout plus :data:`HOST_GRACE_S`). A
call the agent reports ``queued`` (waiting behind another call of its slot, for
admission, or for its shell to start) has none until the agent reports it
``started``; from then on it has the whole deadline again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from . import protocol, tracing
from ._call_group import CallGroup, Reply
from .deadlines import Deadlines
from .drivers.base import SandboxHandle
from .errors import ConfigError, SandboxDiedError, SandboxError, SandboxStartError

log = logging.getLogger("hermes_modal_tool")

#: Extra seconds the host waits past a call's own timeout before giving up on the agent
#: (generous: an overloaded machine delays the agent's kill-and-report procedure).
HOST_GRACE_S = 30.0
#: Streamed output bytes after which the host acknowledges them (agent/shells/streaming.py ACK_BYTES).
STREAM_ACK_BYTES = 64 * 1024
INIT_TIMEOUT_S = 60.0
#: Test-only: seconds a slot's shell may take to start in the agent (default 60; see
#: ``agent/shells/shellprocs.py``), so a test can show a stuck start failing its call quickly.
SHELL_START_TIMEOUT_ENV = "HERMES_MODAL_TOOL_SHELL_START_TIMEOUT_S"


def _with_test_knobs(init_config: dict[str, Any]) -> dict[str, Any]:
    value = os.environ.get(SHELL_START_TIMEOUT_ENV)
    if not value:
        return init_config
    try:
        seconds = float(value)
        if not seconds > 0:
            raise ValueError
    except ValueError:
        raise ConfigError(f"{SHELL_START_TIMEOUT_ENV}={value!r}: expected seconds > 0") from None
    return {**init_config, "shell_start_timeout": seconds}


class Sandbox:
    """A started sandbox with ``slots`` slots, talking to its agent over ``handle``."""

    def __init__(self, sandbox_id: str, handle: SandboxHandle, slots: int,
                 on_death: Callable[[Sandbox], None]) -> None:
        self.sandbox_id = sandbox_id
        self.handle = handle
        self.slots = slots
        self.info: dict[str, Any] = {}
        self.dead = False
        self.death_reason: str | None = None
        self.started_at = time.monotonic()
        self.last_used = self.started_at
        self._last_id = 0  # the last request id given (ids start at 1)
        self._pending: dict[int, asyncio.Future] = {}
        # request id -> (its deadline's entry in self._timers or None, its wait in seconds)
        self._deadlines: dict[int, tuple[list | None, float]] = {}
        self._timers: Deadlines | None = None  # made on the first request's loop
        self._outbox: list[bytes] = []
        # Grouped calls (submit_group) queued since the last flush, each ``[id, slot,
        # tool, args, timeout]``, sent as one ``calls`` frame (see :meth:`flush`).
        self._calls: list[list[Any]] = []
        self._groups: dict[int, CallGroup] = {}  # id of a grouped call not answered yet -> its group
        self._listeners: dict[int, Callable[[dict[str, Any]], None]] = {}
        self._unacked = 0  # streamed output received and not yet acknowledged
        self._on_death = on_death
        self._reader: asyncio.Task | None = None
        self._closing = False

    # -- lifecycle -----------------------------------------------------------
    async def initialize(self, init_config: dict[str, Any]) -> dict[str, Any]:
        """Start reading and send ``init``; return the agent's capabilities.

        Raises:
            SandboxStartError: the agent did not answer or refused the config.
        """
        self._decoder = protocol.FrameDecoder()
        init_config = _with_test_knobs(init_config)
        if not self.handle.attach(self._on_data, self._on_close):
            self._reader = asyncio.get_running_loop().create_task(
                self._read_loop(), name=f"hermes-modal-tool reader {self.sandbox_id}")
        try:
            reply = await self.request({"op": "init", "config": init_config}, INIT_TIMEOUT_S)
        except SandboxError as exc:
            raise SandboxStartError(f"sandbox {self.sandbox_id} did not start: {exc}") from None
        if not reply.get("ok"):
            if reply.get("kind") == "GpuMissing":  # agent/limits/gpu.py: a gpu profile, no GPU there
                from .errors import GpuUnavailableError

                raise GpuUnavailableError(f"sandbox {self.sandbox_id}: {reply.get('error')}")
            raise SandboxStartError(f"sandbox {self.sandbox_id} refused its config: {reply.get('error')}")
        self.info = reply["result"]
        return self.info

    def _on_data(self, chunk: bytes) -> None:
        try:
            messages = self._decoder.feed(chunk)
        except protocol.ProtocolError as exc:
            self._mark_dead(f"protocol error from the agent: {exc}")
            return
        pending = self._pending
        for msg in messages:
            mid = msg.get("id")
            fut = pending.pop(mid, None)
            if fut is not None:
                self._forget(mid)
                if not fut.done():
                    fut.set_result(msg)
            elif "results" in msg:
                self._on_results(msg["results"])
            elif mid in self._groups:  # a grouped call answered in a frame of its own
                self._answer(self._groups.pop(mid), mid, Reply(msg))  # type: ignore[arg-type]
            elif "event" in msg:
                self._on_event(msg)

    def _on_results(self, results: list[list[Any]]) -> None:
        """A ``results`` frame: ``[id, result]`` of several calls sent in a ``calls`` frame
        (the agent sends a batch's results together). Each call's group gets its result
        (the agent leaves out the fields of a result that have their default value: no
        error, not timed out, not truncated, no data, which
        :meth:`ExecutionResult.from_agent` fills in); an entry that is not ``[id, an
        object]`` fails its call, if it names one (a ValueError: its answer is lost)."""
        groups = self._groups
        for entry in results:
            try:
                mid, result = entry
                group = groups.pop(mid, None)
            except (TypeError, ValueError):  # not a pair, or an id that cannot be a key
                continue
            if group is None:
                continue
            if type(result) is not dict:
                result = ValueError(f"sandbox {self.sandbox_id}: the agent's result of call {mid} is "
                                    f"not an object: {result!r:.80}")
            self._answer(group, mid, result)

    def _on_event(self, msg: dict[str, Any]) -> None:
        """``queued``: the call waits before it starts (no deadline meanwhile);
        ``started``: its command started (the whole deadline from now); ``output``:
        live output of a call submitted with a listener."""
        mid = msg.get("target")
        if msg["event"] == "output":
            listener = self._listeners.get(mid)  # type: ignore[arg-type]
            if listener is not None:
                listener(msg)
            self._unacked += sum(len(chunk[1]) for chunk in msg.get("chunks") or ())
            if self._unacked >= STREAM_ACK_BYTES:  # the agent's window (agent/shells/streaming.py)
                self._enqueue(protocol.encode({"id": 0, "op": "ack", "bytes": self._unacked}))
                self._unacked = 0
                self.flush()
            return
        group = self._groups.get(mid)  # type: ignore[arg-type]
        if group is not None:
            self._group_event(group, mid, msg["event"])  # type: ignore[arg-type]
            return
        entry = self._deadlines.get(mid)  # type: ignore[arg-type]
        if entry is None or msg["event"] not in ("queued", "started"):
            return
        timer, wait_s = entry
        timers = self._timers_on(asyncio.get_running_loop())
        if timer is not None:
            timers.drop(timer)
        if msg["event"] == "started":
            timer = timers.add(wait_s, self._expire, (mid, wait_s))
        else:
            timer = None
        self._deadlines[mid] = (timer, wait_s)  # type: ignore[index]

    def _group_event(self, group: CallGroup, mid: int, event: str) -> None:
        """``queued`` stops the group's deadline; once every queued call has ``started``
        it starts again, whole (the rule of the module doc, per group)."""
        if event == "queued":
            group.queued.add(mid)
            if group.timer is not None and self._timers is not None:
                self._timers.drop(group.timer)
            group.timer = None
        elif event == "started" and mid in group.queued:
            group.queued.discard(mid)
            if not group.queued:
                self.arm(group)

    def _on_close(self) -> None:
        self._mark_dead(None)

    async def _read_loop(self) -> None:
        reason = None
        try:
            while True:
                chunk = await self.handle.read()
                if not chunk:
                    break
                self._on_data(chunk)
                if self.dead:
                    return
        except protocol.ProtocolError as exc:
            reason = f"protocol error from the agent: {exc}"
        except asyncio.CancelledError:
            reason = "the backend stopped"
            raise
        finally:
            self._mark_dead(reason)

    def _mark_dead(self, reason: str | None) -> None:
        if self.dead:
            return
        self.dead = True
        if reason is None:
            reason = "the sandbox stopped" if self._closing else (
                self.handle.poll() or "the agent closed its stream")
        self.death_reason = reason
        err = SandboxDiedError(f"sandbox {self.sandbox_id} died: {reason}")
        pending, self._pending = self._pending, {}
        for mid in list(self._deadlines):
            self._forget(mid)
        groups, self._groups = self._groups, {}
        for mid, group in groups.items():
            self._answer(group, mid, err)
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)
        if not self._closing:
            log.warning("sandbox %s died: %s", self.sandbox_id, reason)
            self._on_death(self)

    # -- requests ------------------------------------------------------------
    def submit(self, message: dict[str, Any], wait_s: float, flush: bool = True,
               listener: Callable[[dict[str, Any]], None] | None = None,
               ) -> tuple[int, asyncio.Future]:
        """Send one request (now, or at the next :meth:`flush` when ``flush=False``, so a
        batch goes out in one write); return its id and a future for the reply.
        ``listener(event)`` gets the request's ``output`` events until the reply.

        The future fails with SandboxDiedError if the sandbox dies, or SandboxError
        if no reply comes within ``wait_s`` seconds.

        Raises:
            ProtocolError: the message cannot be sent as JSON; nothing was registered.
        """
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if self.dead:
            fut.set_exception(SandboxDiedError(f"sandbox {self.sandbox_id} died: {self.death_reason}"))
            return 0, fut
        self._last_id = mid = self._last_id + 1
        message["id"] = mid
        self._enqueue(protocol.encode(message))  # ProtocolError before anything is registered
        self._pending[mid] = fut
        if listener is not None:
            self._listeners[mid] = listener
        self._deadlines[mid] = (self._timers_on(loop).add(wait_s, self._expire, (mid, wait_s)), wait_s)
        if flush:
            self.flush()
        self.last_used = time.monotonic()
        return mid, fut

    def submit_group(self, group: CallGroup, calls: list[list[Any]]) -> None:
        """Queue ``group``'s calls for the next :meth:`flush`, which sends the queued calls
        in one ``calls`` frame. ``calls``: ``[0, slot index, tool, args, timeout]`` each
        (seconds), in the group's order; each gets its id in place of the 0, one after
        another from the group's ``first``. Their outcomes come in ``group`` (see
        ``_call_group.py``; start the group's deadline with :meth:`arm`). A call JSON
        cannot carry gets that ProtocolError as its outcome at the flush; a dead
        sandbox's calls get SandboxDiedError at once."""
        first = self._last_id + 1
        self._last_id += len(calls)
        group.open(first, len(calls))
        if self.dead:
            err = SandboxDiedError(f"sandbox {self.sandbox_id} died: {self.death_reason}")
            for mid in range(first, first + len(calls)):
                group.answer(mid, err)
            return
        groups = self._groups
        for mid, call in enumerate(calls, first):
            call[0] = mid
            groups[mid] = group
        self._calls += calls

    def arm(self, group: CallGroup) -> None:
        """Start ``group``'s deadline (the longest wait of its calls), unless it is complete."""
        if group.left and group.timer is None and not self.dead:
            group.timer = self._timers_on(asyncio.get_running_loop()).add(
                group.wait_s, self._expire_group, group)
        self.last_used = time.monotonic()

    def abandon(self, group: CallGroup) -> None:
        """The caller stopped waiting for ``group`` (cancelled): ask the agent to stop its
        calls that have not answered, last ones first, in one write; their entries go when
        the agent answers (it answers a cancelled call too) or at the group's deadline."""
        for mid in group.unanswered():
            self.cancel(mid, flush=False)
        self.flush()

    def _enqueue(self, frame: bytes) -> None:
        """Queue ``frame`` for the next :meth:`flush`, after the compact calls queued before it."""
        if self._calls:
            calls, self._calls = self._calls, []
            self._outbox.extend(self._calls_frames(calls))
        self._outbox.append(frame)

    def flush(self) -> None:
        """Write the queued request frames (one write for a whole batch)."""
        if self._calls:
            calls, self._calls = self._calls, []
            self._outbox.extend(self._calls_frames(calls))
        if self._outbox:
            data = b"".join(self._outbox) if len(self._outbox) > 1 else self._outbox[0]
            self._outbox.clear()
            if not self.dead:
                self.handle.write(data)

    def _calls_frames(self, calls: list[list[Any]]) -> list[bytes]:
        """``calls`` frames for compact calls (``[id, slot, tool, args, timeout]`` each): one
        frame for all of them unless JSON cannot carry one call or the frame would pass
        the size limit; then halves, down to the call that cannot go, whose outcome in its
        group is that ProtocolError (the others go)."""
        try:
            return [protocol.encode({"id": 0, "op": "calls", "calls": calls})]
        except protocol.ProtocolError as exc:
            if len(calls) > 1:
                half = len(calls) // 2
                return self._calls_frames(calls[:half]) + self._calls_frames(calls[half:])
            mid = calls[0][0]
            group = self._groups.pop(mid, None)
            if group is not None:
                self._answer(group, mid, exc)
            return []

    def _answer(self, group: CallGroup, mid: int, outcome: Any) -> None:
        if group.answer(mid, outcome):
            self._drop_deadline(group)

    def _drop_deadline(self, group: CallGroup) -> None:
        """The complete ``group`` needs its deadline no more."""
        if self._timers is not None and group.timer is not None:
            self._timers.drop(group.timer)
        group.timer = None

    def _expire_group(self, group: CallGroup) -> None:
        group.timer = None
        err = SandboxError(f"sandbox {self.sandbox_id}: the agent did not answer within {group.wait_s:g}s")
        for mid in group.unanswered():
            self._groups.pop(mid, None)
            group.answer(mid, err)
            self.cancel(mid, flush=False)
        self.flush()

    def _forget(self, mid: int) -> None:
        self._listeners.pop(mid, None)
        timer, _ = self._deadlines.pop(mid, (None, 0.0))
        if timer is not None and self._timers is not None:
            self._timers.drop(timer)

    def _timers_on(self, loop: asyncio.AbstractEventLoop) -> Deadlines:
        """The requests' deadlines, on ``loop`` (one loop timer for all of them)."""
        timers = self._timers
        if timers is None or timers.loop is not loop:
            timers = self._timers = Deadlines(loop)
        return timers

    def _expire(self, request: tuple[int, float]) -> None:
        mid, wait_s = request
        fut = self._pending.pop(mid, None)
        self._forget(mid)
        if fut is not None and not fut.done():
            fut.set_exception(SandboxError(
                f"sandbox {self.sandbox_id}: the agent did not answer within {wait_s:g}s"))
            self.cancel(mid)

    def cancel(self, mid: int, flush: bool = True) -> None:
        """Ask the agent to stop request ``mid`` (kills what it started). Fire and forget.

        With ``flush=False`` the frame waits for :meth:`flush`, so that several cancels
        reach the agent in one write and take effect together. The request's output
        events stop reaching its listener now; its entry is dropped when the agent
        answers (it answers a cancelled call too) or when its deadline passes.
        """
        self._listeners.pop(mid, None)
        if not self.dead and mid:
            self._enqueue(protocol.encode({"id": 0, "op": "cancel", "target": mid}))
            if flush:
                self.flush()

    async def request(self, message: dict[str, Any], wait_s: float) -> dict[str, Any]:
        mid, fut = self.submit(message, wait_s)
        return await self.reply(mid, fut)

    async def reply(self, mid: int, fut: asyncio.Future) -> dict[str, Any]:
        """The reply of request ``mid`` (``fut``, both from :meth:`submit`); cancelled, it
        cancels the request."""
        try:
            return await fut
        except asyncio.CancelledError:
            self.cancel(mid)
            raise

    async def ask(self, message: dict[str, Any], wait_s: float, what: str,
                  error: type[Exception]) -> dict[str, Any]:
        """:meth:`request`, unwrapped: the reply's ``result`` (with the ``blob`` of a binary
        reply). ``what`` starts the error's message.

        Raises:
            error: the agent refused the request, did not answer within ``wait_s``
                seconds, or the sandbox died.
        """
        mid, fut = self.submit(message, wait_s)
        return await self.answer(mid, fut, what, error)

    async def answer(self, mid: int, fut: asyncio.Future, what: str,
                     error: type[Exception]) -> dict[str, Any]:
        """The :meth:`reply` of request ``mid`` (``fut``, both from :meth:`submit`),
        unwrapped as :meth:`ask` does. :meth:`submit` then this: the message is encoded (a
        ``blob`` copied out) before the caller goes on, so the caller may reuse the blob's
        buffer at once (an upload's read buffers).

        Raises:
            error: the agent refused the request, did not answer in time, or the
                sandbox died.
        """
        try:
            got = await self.reply(mid, fut)
        except SandboxError as exc:
            raise error(f"{what}: {exc}") from None
        if not got.get("ok"):
            raise error(f"{what}: {got.get('error')}")
        result = got.get("result") or {}
        if "blob" in got:
            result["blob"] = got["blob"]
        return result

    # -- shutdown ------------------------------------------------------------
    async def close(self) -> None:
        """Ask the agent to clean up and exit; then make sure the sandbox is gone."""
        if not tracing.active():
            return await self._close()
        with tracing.span("sandbox.stop", {"sandbox_id": self.sandbox_id, "died": self.dead or None}):
            await self._close()

    async def _close(self) -> None:
        self._closing = True
        if not self.dead:
            try:
                await self.request({"op": "shutdown"}, 10.0)
            except (SandboxError, asyncio.TimeoutError):
                pass
        try:
            await self.handle.terminate()
        finally:
            if self._reader is not None:
                self._reader.cancel()
                try:
                    await self._reader
                except (asyncio.CancelledError, Exception):
                    pass
            self._mark_dead("the sandbox stopped")
