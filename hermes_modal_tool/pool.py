"""One pool of sandboxes per profile: warm minimum, growth to the maximum, idle scale-down.

Slot accounting follows anyio's ``CapacityLimiter``: a slot is leased to one
borrower (a trajectory); ``release`` of something not held raises; waiters are
served first come, first served. Background work (sandbox starts, resets, the
idle reaper) runs in tasks the pool owns and cancels and awaits on ``stop()``.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import time
import uuid
from collections import deque
from typing import Any

from . import tracing
from ._pool_calls import PoolCalls
from ._pool_pick import SlotPick
from ._pool_status import PoolStatus
from ._pool_usage import PoolUsage
from ._slot_record import SlotRecord as _Record
from .config import SandboxConfig
from .drivers.base import Driver
from .errors import (
    BackendClosedError,
    PoolTimeoutError,
    UsageError,
)
from .resets import SlotResets
from .sandbox import Sandbox
from .slots import Slot, SlotState
from .slots import execution_id as new_id
from .usage import Usage

#: Seconds one sandbox may take to start (the driver's start and the agent's init);
#: ``HERMES_MODAL_TOOL_START_TIMEOUT_S`` sets another (an emulated VM of the host matrix
#: needs minutes: tests/hosts).
START_TIMEOUT_S = float(os.environ.get("HERMES_MODAL_TOOL_START_TIMEOUT_S") or 120.0)


class SandboxPool(SlotResets, SlotPick, PoolStatus, PoolUsage, PoolCalls):
    """Sandboxes of one profile, each with ``slots_per_sandbox`` slots.

    Args:
        config: the profile.
        driver: starts the sandboxes.
    """

    def __init__(self, config: SandboxConfig, driver: Driver, id_tag: str = "") -> None:
        self.config = config
        self.id_tag = id_tag  # sandbox ids are "{profile}-{id_tag}{N}"
        self.name = config.name
        self.driver = driver
        self._sandboxes: dict[str, Sandbox] = {}
        self._records: dict[str, list[_Record]] = {}
        self._free: deque[_Record] = deque()
        self._held: dict[str, int] = {}  # sandbox id -> slots leased in it (config.spread)
        self._waiters: deque[asyncio.Future] = deque()
        self._starting = 0
        self._tasks: set[asyncio.Task] = set()
        self._closers: set[asyncio.Task] = set()
        self._seq = itertools.count()
        self._reaper: asyncio.Task | None = None
        self._started = False
        self._closed = False
        self.stats = {"calls": 0, "failures": 0, "timeouts": 0, "sandboxes_started": 0,
                      "sandboxes_died": 0, "sandboxes_stopped": 0, "acquires": 0, "quarantined": 0,
                      "network_refused": 0}
        self.last_error: str | None = None
        self.info: dict[str, Any] = {}
        self._rate_window: deque[list[int]] = deque()  # [tick, calls] (_pool_status.py)
        self._usage_init()

    # -- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        """Start the idle reaper and pre-warm ``min_sandboxes`` (concurrently).

        Raises:
            SandboxStartError: a warm sandbox failed to start (the pool is stopped).
        """
        if self._closed:
            raise BackendClosedError(f"pool {self.name!r} was stopped")
        if self._started:
            return
        self._started = True
        self._reaper = asyncio.get_running_loop().create_task(
            self._reap_idle(), name=f"hermes-modal-tool reaper {self.name}")
        want = self.config.min_sandboxes
        if want:
            self._starting += want
            results = await asyncio.gather(*(self._start_one(counted=True) for _ in range(want)),
                                           return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                await self.stop()
                raise errors[0]

    async def stop(self) -> None:
        """Terminate every sandbox this pool started; fail waiters. Idempotent."""
        if self._closed and not self._sandboxes and not self._tasks and not self._closers:
            return
        self._closed = True
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_exception(BackendClosedError(f"pool {self.name!r} is stopping"))
        tasks = list(self._tasks) + ([self._reaper] if self._reaper else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        sandboxes = list(self._sandboxes.values())
        for sb in sandboxes:
            self._sandbox_ended(sb)
        self._sandboxes.clear()
        self._free.clear()
        self._held.clear()
        for recs in self._records.values():
            for rec in recs:
                if rec.holder is not None:
                    rec.holder.state = SlotState.ERROR
                    rec.holder.error = "the backend was stopped"
                rec.lease += 1
        self._records.clear()
        await asyncio.gather(*(sb.close() for sb in sandboxes), *list(self._closers),
                             return_exceptions=True)
        while pending := [t for t in self._closers if not t.done()]:  # died meanwhile
            await asyncio.gather(*pending, return_exceptions=True)
        self.stats["sandboxes_stopped"] += len(sandboxes)

    def _spawn(self, coro, name: str, closing: bool = False) -> asyncio.Task:
        """Run ``coro`` as a task the pool owns. ``closing`` tasks (stopping a sandbox) are
        awaited, not cancelled, by :meth:`stop`, so nothing is left half-stopped."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        owner = self._closers if closing else self._tasks
        owner.add(task)
        task.add_done_callback(owner.discard)
        return task

    # -- sandboxes ---------------------------------------------------------------
    async def _start_one(self, counted: bool = False) -> Sandbox:
        """Start one sandbox and offer its slots. ``counted``: ``_starting`` already includes it."""
        if not tracing.active():
            return await self._start_sandbox(counted)
        with tracing.span("sandbox.start", {"profile": self.name, "driver": self.config.driver}) as span:
            sb = await self._start_sandbox(counted)
            tracing.set_attributes(span, {"sandbox_id": sb.sandbox_id})
            return sb

    async def _start_sandbox(self, counted: bool) -> Sandbox:
        if not counted:
            self._starting += 1
        sandbox_id = f"{self.name}-{self.id_tag}{next(self._seq)}"
        handle = None
        try:
            handle, init = await asyncio.wait_for(
                self.driver.start_sandbox(self.config, sandbox_id), START_TIMEOUT_S)
            sb = Sandbox(sandbox_id, handle, self.config.slots_per_sandbox, self._on_death)
            try:
                self.info = await sb.initialize(init)
                self.driver.started(init, self.info)
            except BaseException:
                await sb.close()
                handle = None
                raise
            self._warn_degraded()
        except BaseException as exc:
            self._starting -= 1
            if handle is not None:
                await handle.terminate()
            if not isinstance(exc, asyncio.CancelledError):
                self.last_error = str(exc)
                self._fail_unservable(exc)
            raise
        self._starting -= 1
        if self._closed:
            await sb.close()
            raise BackendClosedError(f"pool {self.name!r} was stopped while starting {sandbox_id}")
        self.stats["sandboxes_started"] += 1
        base = self.config.workspace_base if self.info.get("isolation") != "none" else None
        recs = []
        for i in range(self.config.slots_per_sandbox):
            ws = f"{base}/slot_{i}" if base else f"{init['host_root']}/slot_{i}"
            recs.append(_Record(sb, i, f"{sandbox_id}_slot_{i}", ws))
        self._sandboxes[sandbox_id] = sb
        self._records[sandbox_id] = recs
        now = time.monotonic()
        for rec in reversed(recs):  # slot_0 is taken first
            self._offer(rec, now)
        return sb

    def _fail_unservable(self, exc: BaseException) -> None:
        """After a failed start, fail the waiters that no other starting sandbox will serve."""
        coming = self._starting * self.config.slots_per_sandbox
        while len(self._waiters) > coming:
            w = self._waiters.pop()
            if not w.done():
                w.set_exception(exc)

    def _on_death(self, sb: Sandbox) -> None:
        if self._sandboxes.pop(sb.sandbox_id, None) is None:
            return
        self._sandbox_ended(sb)
        self.stats["sandboxes_died"] += 1
        self.last_error = f"sandbox {sb.sandbox_id} died: {sb.death_reason}"
        recs = self._records.pop(sb.sandbox_id, [])
        self._held.pop(sb.sandbox_id, None)
        dead = set(map(id, recs))
        self._free = deque(r for r in self._free if id(r) not in dead)
        for rec in recs:
            rec.lease += 1
            if rec.holder is not None:
                rec.holder.state = SlotState.ERROR
                rec.holder.error = self.last_error
        # Also while the pool stops: stop() no longer lists this sandbox, and only its
        # close removes what it left on the host (its state, its cgroups).
        self._spawn(sb.close(), f"hermes-modal-tool close {sb.sandbox_id}", closing=True)
        if not self._closed:
            self._grow()

    def _live(self) -> int:
        return len(self._sandboxes)

    def _grow(self) -> None:
        """Start sandboxes for waiting demand and the warm minimum, up to the maximum."""
        if self._closed or not self._started:
            return
        spb = self.config.slots_per_sandbox
        demand = len(self._waiters) - self._starting * spb - len(self._free)
        need = max(0, -(-demand // spb), self.config.min_sandboxes - self._live() - self._starting)
        room = self.config.max_sandboxes - self._live() - self._starting
        for _ in range(max(0, min(need, room))):
            self._starting += 1
            task = self._spawn(self._start_one(counted=True), f"hermes-modal-tool start {self.name}")
            task.add_done_callback(_swallow)

    async def _reap_idle(self) -> None:
        idle_limit = self.config.scale_down_after  # None: never scale down
        interval = min(max(min(self.config.idle_timeout, idle_limit or math.inf) / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for sid, sb in list(self._sandboxes.items()):
                recs = self._records.get(sid, [])
                if not all(r.holder is None and not r.promised
                           and (r.ready or "gave_up" in r.extra.get("quarantine", ())) for r in recs):
                    continue
                if now - sb.started_at > self.config.max_lifetime:
                    self._retire(sb)  # replaced below if that leaves fewer than the minimum
                elif (idle_limit is not None and self._live() > self.config.min_sandboxes
                      and now - sb.last_used > idle_limit):
                    self._retire(sb)
            self._grow()

    def _retire(self, sb: Sandbox) -> None:
        self._sandboxes.pop(sb.sandbox_id, None)
        self._sandbox_ended(sb)
        recs = self._records.pop(sb.sandbox_id, [])
        self._held.pop(sb.sandbox_id, None)
        gone = set(map(id, recs))
        self._free = deque(r for r in self._free if id(r) not in gone)
        for rec in recs:
            rec.lease += 1
        self.stats["sandboxes_stopped"] += 1
        self._spawn(sb.close(), f"hermes-modal-tool retire {sb.sandbox_id}", closing=True)

    # -- slots ---------------------------------------------------------------------
    def _offer(self, rec: _Record, when: float | None = None) -> None:
        if rec.sandbox.dead or rec.sandbox.sandbox_id not in self._sandboxes:
            return
        rec.offered = time.monotonic() if when is None else when
        rec.promised = False
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                # Its acquire leases it when it next runs; until then the reaper must not
                # retire the sandbox under it (a loaded loop can run the reaper first).
                rec.promised = True
                w.set_result(rec)
                return
        self._free.append(rec)

    async def acquire(self, trajectory_id: str | None = None) -> Slot:
        """Lease a slot with an empty workspace and a fresh shell.

        Raises:
            PoolTimeoutError: none became free within ``acquire_timeout_s``; the
                message says how many slots exist and who holds them.
            SandboxStartError: a sandbox needed for this acquire failed to start.
            BackendClosedError: the pool was stopped.
        """
        if self._closed:
            raise BackendClosedError(f"pool {self.name!r} was stopped")
        if not self._started:
            await self.start()
        rec = self._take_free()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.acquire_timeout_s
        # A promised slot whose sandbox died before this acquire ran is not leased: wait again.
        while rec is None or rec.sandbox.dead or rec.sandbox.sandbox_id not in self._sandboxes:
            fut = loop.create_future()
            self._waiters.append(fut)
            self._grow()
            try:
                rec = await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise PoolTimeoutError(self._timeout_message()) from None
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    self._offer(fut.result())
                raise
        return self._lease(rec, trajectory_id)

    def lease_free_in(self, sandbox_id: str, trajectory_id: str | None) -> Slot | None:
        """Lease a free slot of sandbox ``sandbox_id`` now (forks go next to their
        snapshot); None when it has none free."""
        for rec in reversed(self._free):
            if rec.sandbox.sandbox_id == sandbox_id and not rec.sandbox.dead:
                self._free.remove(rec)
                return self._lease(rec, trajectory_id)
        return None

    def _timeout_message(self) -> str:
        holders = [r.holder.trajectory_id or r.slot_id for recs in self._records.values()
                   for r in recs if r.holder is not None]
        total = sum(len(r) for r in self._records.values())
        shown = ", ".join(map(str, holders[:10])) + (f", ... ({len(holders) - 10} more)" if len(holders) > 10 else "")
        why = f"; last error: {self.last_error}" if self.last_error else ""
        return (f"no slot free in profile {self.name!r} within {self.config.acquire_timeout_s:g}s: "
                f"{total} slots in {self._live()} sandboxes (max_sandboxes={self.config.max_sandboxes}, "
                f"slots_per_sandbox={self.config.slots_per_sandbox}), {len(holders)} held"
                + (f" by {shown}" if holders else "") + why)

    def _lease(self, rec: _Record, trajectory_id: str | None) -> Slot:
        rec.lease += 1
        slot = Slot(slot_id=rec.slot_id, workspace_dir=rec.workspace_dir, state=SlotState.ACQUIRED,
                    trajectory_id=trajectory_id, sandbox_id=rec.sandbox.sandbox_id,
                    profile=self.name, index=rec.index, acquired_at=time.time(),
                    lease_id=str(uuid.UUID(new_id())), _lease=rec.lease, _sandbox=rec,
                    _held_since=time.monotonic())
        rec.holder, rec.promised = slot, False
        sid = rec.sandbox.sandbox_id
        self._held[sid] = self._held.get(sid, 0) + 1
        rec.sandbox.last_used = time.monotonic()
        self.stats["acquires"] += 1
        return slot

    def record_of(self, slot: Slot) -> _Record:
        """The record a slot leases; raise UsageError if the lease is no longer valid."""
        rec = slot._sandbox
        if not isinstance(rec, _Record) or rec.holder is not slot or rec.lease != slot._lease:
            why = f" ({slot.error})" if slot.error else ""
            raise UsageError(f"slot {slot.slot_id} is not held by this caller: it was released, "
                             f"its sandbox is gone, or it came from another backend{why}")
        return rec

    async def release(self, slot: Slot, reset_workspace: bool = False,
                      measure_disk: bool = False) -> Usage | None:
        """Give a slot back. Its workspace and shell are always reset before reuse:
        now (``reset_workspace=True``) or in the background. Returns what the lease
        used (:class:`Usage`, measured before the reset); None for a slot whose lease
        already ended with its sandbox and was released before.

        Raises:
            UsageError: the slot is not currently held.
        """
        if slot.state is SlotState.ERROR and not isinstance(slot._sandbox, _Record):
            return None
        try:
            rec = self.record_of(slot)
        except UsageError:
            if slot.state is SlotState.ERROR:  # its sandbox died; nothing to give back
                return await self._ended_lease_usage(slot)
            raise
        slot.state = SlotState.RELEASING
        rec.holder = None
        sid = rec.sandbox.sandbox_id
        if sid in self._held:
            self._held[sid] -= 1
        rec.lease += 1
        rec.ready = False
        rec.sandbox.last_used = time.monotonic()
        held = self._lease_ended(slot)
        if reset_workspace and not measure_disk:
            # The usage request goes out with the reset's (one write, one round trip).
            asked = self._ask_usage(rec)
            await self._reset(rec)
            usage = await self._usage_of(asked, slot, held)
        else:  # (a disk walk must see the old layer: it is measured before the reset)
            usage = await self._measure(rec, slot, held, measure_disk)
            if reset_workspace:
                await self._reset(rec)
            else:
                self._spawn(self._reset(rec), f"hermes-modal-tool reset {rec.slot_id}")
        slot.state = SlotState.AVAILABLE
        slot.trajectory_id = None
        return usage

def _swallow(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: failures are reported through waiters and last_error
