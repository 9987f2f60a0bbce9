"""The backend's snapshot, fork and shared-setup methods (a part of :class:`ToolBackend`).

See :mod:`hermes_modal_tool.snapshots` (slot snapshots and forks),
:mod:`hermes_modal_tool.shared_setup` (setup keyed by content),
:mod:`hermes_modal_tool.transfer` (tar streams) and
:mod:`hermes_modal_tool.sandbox_images` (Modal filesystem snapshots).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import TYPE_CHECKING

from . import tracing
from .slots import Slot
from .snapshots import SlotSnapshot

if TYPE_CHECKING:
    from .shared_setup import SharedSetups
    from .snapshots import Snapshots


class SnapshotMethods:
    """Mixed into :class:`~hermes_modal_tool.backend.ToolBackend`."""

    _snapshots: Snapshots
    _setups: SharedSetups

    if TYPE_CHECKING:
        def _check_open(self) -> None: ...  # ToolBackend's

    async def snapshot(self, slot: Slot) -> SlotSnapshot:
        """Freeze a slot's state into an immutable snapshot held by its sandbox.

        The state is the slot's files (its whole writable root) and its shell's working
        directory, exported variables, functions and aliases. The slot keeps running
        from the same state, but its processes are restarted: background jobs are not
        part of a snapshot and are stopped by it. Costs a shell restart, whatever the
        size of the state. The caller holds the snapshot until :meth:`release_snapshot`.

        Raises:
            UsageError: the slot is not held.
            SnapshotError: the slots of this profile have no layered root
                (``filesystem: workspace-only``), or the sandbox's snapshots would pass
                the profile's ``snapshot_disk`` cap (MiB).
        """
        self._check_open()
        with tracing.span("snapshot", {"slot_id": getattr(slot, "slot_id", None)}) as span:
            snap = await self._snapshots.snapshot(slot)
            tracing.set_attributes(span, {"snapshot_id": snap.snapshot_id, "size_bytes": snap.size_bytes})
            return snap

    async def fork(self, slot_or_snapshot: Slot | SlotSnapshot, n: int,
                   trajectory_ids: list[str] | None = None) -> list[Slot]:
        """``n`` new slots starting from a slot's current state or a snapshot.

        Each fork gets its own empty writable layer stacked on the frozen state, so a
        fork costs a few mounts whatever the size of the state; what a fork writes no
        other slot sees. Forks go to free slots of a sandbox holding the snapshot first,
        then to other sandboxes of the profile (the frozen layer is copied there once).
        Forking a slot takes a snapshot of it first (which restarts its processes, see
        :meth:`snapshot`) and lets the forks hold it.

        Args:
            slot_or_snapshot: a held :class:`Slot`, or a :class:`SlotSnapshot`.
            n: how many forks (>= 1).
            trajectory_ids: one id per fork (default: new ``traj-...`` ids).

        Returns:
            ``n`` held slots, released with :meth:`release` like any other.

        Raises:
            UsageError: bad arguments, a released snapshot, a slot not held.
            SnapshotError: the snapshot could not be taken, moved or stacked.
            PoolTimeoutError: not enough slots became free within ``acquire_timeout_s``.
        """
        self._check_open()
        with tracing.span("fork", {"snapshot_id": getattr(slot_or_snapshot, "snapshot_id", None),
                                   "slot_id": getattr(slot_or_snapshot, "slot_id", None), "count": n}):
            return await self._snapshots.fork(slot_or_snapshot, n, trajectory_ids)

    async def setup_snapshot(self, setup: str | list[str], profile: str | None = None) -> SlotSnapshot:
        """The snapshot of a slot of ``profile`` after ``setup`` (commands run in order in
        one fresh slot, each in the shell the previous left). Keyed by content (sha256 of
        the commands, the profile and its image): the first request for a key runs it,
        concurrent ones wait for that run, later ones get its snapshot at once. The
        backend holds it until ``stop()``; fork from it, do not release it.

        Raises:
            SetupError: a command failed (``.output`` is what the setup printed); every
                waiter gets it and the next request runs the setup again.
            UsageError: ``setup`` is not a command or a list of commands.
        """
        self._check_open()
        return await self._setups.snapshot_for(setup, profile)

    def export_snapshot(self, snapshot: SlotSnapshot) -> AsyncIterator[bytes]:
        """A snapshot as a tar stream: an async iterator of chunks (bytes, up to 4 MiB each)
        for :meth:`import_snapshot` here or in another backend, machine or driver (also
        the shape of the OpenAI Agents SDK's ``persist_workspace``).

        Raises:
            UsageError: a released snapshot or one of another backend.
            SnapshotError: (while iterating) the sandbox holding it failed or is gone.
        """
        self._check_open()
        return self._snapshots.export(snapshot)

    async def import_snapshot(self, data: bytes | Iterable[bytes] | AsyncIterable[bytes],
                              profile: str | None = None) -> SlotSnapshot:
        """A snapshot from a tar stream made by :meth:`export_snapshot` (bytes, or an
        iterable or async iterable of chunks), held by a sandbox of ``profile``; the
        caller holds it (:meth:`release_snapshot`).

        Raises:
            SnapshotError: the stream is not a snapshot, is damaged, or comes from slots
                with other layer roots (another image).
        """
        self._check_open()
        return await self._snapshots.import_(data, profile)

    async def snapshot_sandbox(self, profile: str | None = None, setup: str | list[str] | None = None,
                               *, use: bool = True, timeout_s: int = 600) -> str:
        """Turn a prepared sandbox of a Modal profile into the image its new sandboxes
        start from (Modal's ``Sandbox.snapshot_filesystem``); return the image id.

        ``setup`` commands run first in the container itself (as its root, outside every
        slot; each with ``timeout_s``). With ``use`` (default) the profile's ``image``
        becomes that id, so sandboxes started from now on (not those running) have it in
        the root their slots share. Images of Modal's filesystem snapshots expire (Modal
        keeps them for a limited time).

        Raises:
            UsageError: the profile does not use the Modal driver.
            SetupError: a setup command failed (``.output``).
            SnapshotError: Modal refused the snapshot.
        """
        from .sandbox_images import snapshot_sandbox

        self._check_open()
        return await snapshot_sandbox(self, profile, setup, use, timeout_s)

    async def release_snapshot(self, snapshot: SlotSnapshot) -> None:
        """Let go of a snapshot (idempotent). Its files are deleted once no slot forked
        from it is held either."""
        self._check_open()
        await self._snapshots.release(snapshot)

