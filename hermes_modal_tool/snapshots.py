"""Slot snapshots and forks, as the host sees them (the backend's ``snapshot``/``fork``).

A :class:`SlotSnapshot` names a frozen slot state (files and shell state) held by one or
more sandboxes of a profile. Forks go to free slots of a sandbox that holds it first (a
fork there is a few mounts, whatever the size of the state), then to other sandboxes of
the same profile: the frozen layer moves there once, as a tar stream through the agents
(:mod:`hermes_modal_tool.transfer`), and every later fork there stacks on that copy.

Reference counts: the caller holds a snapshot from :meth:`ToolBackend.snapshot` until
:meth:`ToolBackend.release_snapshot`; each slot forked from it holds it until that slot
is released. The sandboxes delete a snapshot's files when its last holder lets go.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import HermesModalToolError, SnapshotError, UsageError
from .slots import Slot, SlotState

if TYPE_CHECKING:
    from ._backend_view import BackendView
    from .pool import SandboxPool
    from .sandbox import Sandbox

log = logging.getLogger("hermes_modal_tool")

#: Seconds a snapshot or fork message may take in the agent (a shell stop, a few mounts).
SNAPSHOT_WAIT_S = 120.0
_SEQ = itertools.count(1)


@dataclass(eq=False)
class SlotSnapshot:
    """A frozen slot state: its files (the slot's writable layer) and shell state
    (working directory, exported variables, functions, aliases). Background processes
    are not part of it. Immutable; start slots from it with :meth:`ToolBackend.fork` or
    ``acquire(snapshot=...)``; release it with :meth:`ToolBackend.release_snapshot`.

    Attributes:
        snapshot_id: ``"snap-N"`` (``"snap-hK.N"`` when made in host process K, see
            ``host_processes``), unique within a backend.
        profile: the profile whose sandboxes can start from it.
        sandbox_id: the sandbox it was made in.
        size_bytes: bytes of files it holds (its own layer and the layers below it).
        source_trajectory: the trajectory of the slot it was taken from (None: imported).
        created_at: ``time.time()`` when it was made.
    """

    snapshot_id: str
    profile: str
    sandbox_id: str
    size_bytes: int
    source_trajectory: str | None = None
    created_at: float = field(default_factory=time.time)
    released: bool = False
    #: sandbox id -> the agent's id of its copy there
    _copies: dict[str, str] = field(default_factory=dict, repr=False)
    _forks: list[weakref.ref] = field(default_factory=list, repr=False)
    _moving: dict[str, asyncio.Future] = field(default_factory=dict, repr=False)

    def holders(self) -> list[str]:
        """Who holds it now: ``"caller"`` until released, then each live fork's trajectory."""
        out = [] if self.released else ["caller"]
        for ref in self._forks:
            slot = ref()
            if slot is not None and self._holds(slot):
                out.append(slot.trajectory_id or slot.slot_id)
        return out

    @staticmethod
    def _holds(fork: Slot) -> bool:
        """Whether ``fork`` (a slot started from this snapshot) is held: leased and still
        its record's holder."""
        return in_use(fork) and getattr(fork._sandbox, "holder", None) is fork


def in_use(slot: Slot) -> bool:
    """Whether ``slot``'s state is a lease's (not free, failed or being released)."""
    return slot.state not in (SlotState.AVAILABLE, SlotState.ERROR, SlotState.RELEASING)


class Snapshots:
    """A backend's snapshots (one per backend; see :class:`SlotSnapshot`)."""

    def __init__(self, backend: BackendView) -> None:
        self.backend = backend
        self.live: dict[str, SlotSnapshot] = {}
        self._moves: set[asyncio.Task] = set()  # copies to other sandboxes (copy_to)

    async def close(self) -> None:
        """Cancel the copies still moving to other sandboxes and wait for them (the
        backend is stopping; their callers get ``CancelledError``)."""
        moves = list(self._moves)
        for task in moves:
            task.cancel()
        await asyncio.gather(*moves, return_exceptions=True)

    # -- the agent's replies -----------------------------------------------------------
    @staticmethod
    async def ask(sb: Sandbox, message: dict[str, Any], what: str,
                  wait_s: float = SNAPSHOT_WAIT_S) -> dict[str, Any]:
        return await sb.ask(message, wait_s, what, SnapshotError)

    def _pool_of(self, slot: Slot) -> SandboxPool:
        pool = self.backend._pools.get(slot.profile)
        if pool is None:
            raise UsageError(f"slot {slot.slot_id} does not belong to this backend")
        return pool

    def _check(self, snap: Any) -> SlotSnapshot:
        if not isinstance(snap, SlotSnapshot):
            raise UsageError(f"expected a SlotSnapshot, got {type(snap).__name__}")
        if self.live.get(snap.snapshot_id) is not snap:
            raise UsageError(f"snapshot {snap.snapshot_id} does not belong to this backend")
        if snap.released:
            raise UsageError(f"snapshot {snap.snapshot_id} was released; take a new one")
        return snap

    def _new_id(self) -> str:
        """A new snapshot's id: ``snap-N``, with the backend's tag (a host process's)."""
        return f"snap-{self.backend._id_tag}{next(_SEQ)}"

    # -- snapshot ----------------------------------------------------------------------
    async def snapshot(self, slot: Slot) -> SlotSnapshot:
        if not isinstance(slot, Slot):
            raise UsageError(f"snapshot() takes a Slot, got {type(slot).__name__}")
        pool = self._pool_of(slot)
        rec = pool.record_of(slot)
        cap = pool.config.snapshot_disk * 1024 * 1024
        result = await self.ask(rec.sandbox, {"op": "snapshot", "slot": rec.index, "cap_bytes": cap},
                                f"snapshot of slot {slot.slot_id}")
        snap = SlotSnapshot(self._new_id(), pool.name, rec.sandbox.sandbox_id,
                            int(result["size_bytes"]), slot.trajectory_id)
        snap._copies[rec.sandbox.sandbox_id] = result["snapshot"]
        self.live[snap.snapshot_id] = snap
        return snap

    async def release(self, snap: SlotSnapshot) -> None:
        if not isinstance(snap, SlotSnapshot):
            raise UsageError(f"release_snapshot() takes a SlotSnapshot, got {type(snap).__name__}")
        if snap.released or self.live.get(snap.snapshot_id) is not snap:
            return
        snap.released = True
        pool = self.backend._pools.get(snap.profile)
        sandboxes = pool._sandboxes if pool is not None else {}
        for sid, agent_id in list(snap._copies.items()):
            sb = sandboxes.get(sid)
            if sb is not None and not sb.dead:
                try:
                    await self.ask(sb, {"op": "release_snapshot", "snapshot": agent_id},
                                   f"release of {snap.snapshot_id}", 30.0)
                except SnapshotError:
                    pass  # the sandbox is going away: its state goes with it
        snap._copies.clear()

    # -- fork --------------------------------------------------------------------------
    async def fork(self, source: Slot | SlotSnapshot, n: int,
                   trajectory_ids: list[str] | None = None) -> list[Slot]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UsageError(f"n must be a whole number >= 1, got {n!r:.40}")
        if trajectory_ids is not None:
            trajectory_ids = list(trajectory_ids)
            if len(trajectory_ids) != n or not all(isinstance(t, str) for t in trajectory_ids):
                raise UsageError(f"trajectory_ids must be {n} strings (one per fork), got {trajectory_ids!r:.120}")
        if isinstance(source, Slot):
            snap = await self.snapshot(source)
            try:
                return await self._fork(snap, n, trajectory_ids)
            finally:
                await self.release(snap)  # the forks hold it from now on
        return await self._fork(self._check(source), n, trajectory_ids)

    async def _fork(self, snap: SlotSnapshot, n: int, tids: list[str] | None) -> list[Slot]:
        import uuid

        tids = tids or [f"traj-{uuid.uuid4().hex[:12]}" for _ in range(n)]
        pool = await self.backend._pool(snap.profile)
        slots: list[Slot | None] = [None] * n
        # Free slots next to a copy first, then any slot of the profile (which may start
        # sandboxes; the snapshot moves to them).
        for i in range(n):
            for sid in list(snap._copies):
                slots[i] = pool.lease_free_in(sid, tids[i])
                if slots[i] is not None:
                    break
        rest = [i for i in range(n) if slots[i] is None]
        try:
            if rest:
                got = await asyncio.gather(*(pool.acquire(tids[i]) for i in rest), return_exceptions=True)
                for i, slot in zip(rest, got, strict=True):
                    if isinstance(slot, Slot):
                        slots[i] = slot
                errors = [g for g in got if isinstance(g, BaseException)]
                if errors:
                    raise errors[0]
            done = await asyncio.gather(*(self._start_from(snap, pool, s) for s in slots),  # type: ignore[arg-type]
                                        return_exceptions=True)
            errors = [d for d in done if isinstance(d, BaseException)]
            if errors:
                raise errors[0]
        except BaseException:
            for slot in slots:
                if slot is not None:
                    try:
                        await pool.release(slot)
                    except HermesModalToolError:
                        pass
            raise
        for slot in slots:
            snap._forks.append(weakref.ref(slot))  # type: ignore[arg-type]
        return slots  # type: ignore[return-value]

    async def _start_from(self, snap: SlotSnapshot, pool: SandboxPool, slot: Slot) -> None:
        rec = pool.record_of(slot)
        agent_id = await self.copy_to(snap, pool, rec.sandbox)
        await self.ask(rec.sandbox, {"op": "fork", "slot": rec.index, "snapshot": agent_id},
                       f"fork of {snap.snapshot_id} into {slot.slot_id}")

    async def copy_to(self, snap: SlotSnapshot, pool: SandboxPool, sb: Sandbox) -> str:
        """The agent id of ``snap``'s copy in sandbox ``sb`` (moved there once: concurrent
        forks into ``sb`` share one move, a task of this object that :meth:`close` cancels).

        Raises:
            SnapshotError: no sandbox holding it runs, or the move failed (every waiter
                gets the same error; a later fork tries again).
        """
        have = snap._copies.get(sb.sandbox_id)
        if have is not None:
            return have
        moving = snap._moving.get(sb.sandbox_id)
        if moving is None:
            moving = asyncio.get_running_loop().create_task(
                self._move(snap, pool, sb), name=f"hermes-modal-tool copy {snap.snapshot_id} to {sb.sandbox_id}")
            snap._moving[sb.sandbox_id] = moving
            self._moves.add(moving)
            moving.add_done_callback(functools.partial(self._moved, snap, sb.sandbox_id))
        return await asyncio.shield(moving)

    def _moved(self, snap: SlotSnapshot, sandbox_id: str, task: asyncio.Task) -> None:
        self._moves.discard(task)
        if snap._moving.get(sandbox_id) is task:
            del snap._moving[sandbox_id]  # failed moves are not cached: the next fork retries
        if not task.cancelled() and task.exception() is not None:
            log.warning("copy of snapshot %s to sandbox %s failed: %s",
                        snap.snapshot_id, sandbox_id, task.exception())

    async def _move(self, snap: SlotSnapshot, pool: SandboxPool, sb: Sandbox) -> str:
        from . import transfer

        source = next((pool._sandboxes.get(s) for s in snap._copies if s in pool._sandboxes), None)
        if source is None:
            raise SnapshotError(f"snapshot {snap.snapshot_id}: no sandbox holding it is running")
        agent_id = await transfer.copy_between(self, source, snap._copies[source.sandbox_id], sb,
                                               pool.config.snapshot_disk * 1024 * 1024)
        snap._copies[sb.sandbox_id] = agent_id
        return agent_id

    # -- export and import -------------------------------------------------------------
    def export(self, snap: SlotSnapshot) -> AsyncIterator[bytes]:
        from . import transfer

        snap = self._check(snap)
        pool = self.backend._pools.get(snap.profile)
        for sid, agent_id in snap._copies.items():
            sb = pool._sandboxes.get(sid) if pool is not None else None
            if sb is not None and not sb.dead:
                return transfer.export_chunks(self, sb, agent_id)
        raise SnapshotError(f"snapshot {snap.snapshot_id}: no sandbox holding it is running")

    async def import_(self, data: Any, profile: str | None) -> SlotSnapshot:
        from . import transfer

        pool = await self.backend._pool(self.backend.profile(profile).name)
        sb = next((s for s in pool._sandboxes.values() if not s.dead), None)
        if sb is None:  # start one: lease a slot and give it back
            slot = await pool.acquire("import-snapshot")
            sb = pool.record_of(slot).sandbox
            await pool.release(slot)
        reply = await transfer.import_chunks(self, sb, data)
        snap = SlotSnapshot(self._new_id(), pool.name, sb.sandbox_id, int(reply["size_bytes"]))
        snap._copies[sb.sandbox_id] = reply["snapshot"]
        self.live[snap.snapshot_id] = snap
        return snap

    # -- status ------------------------------------------------------------------------
    def status(self) -> list[dict[str, Any]]:
        out = []
        for sid, snap in list(self.live.items()):
            holders = snap.holders()
            if not holders:
                del self.live[sid]
                continue
            out.append({"snapshot_id": sid, "profile": snap.profile, "sandbox_id": snap.sandbox_id,
                        "sandboxes": sorted(snap._copies), "size_bytes": snap.size_bytes,
                        "holders": holders, "source_trajectory": snap.source_trajectory})
        return out
