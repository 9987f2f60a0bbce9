"""The pool's part of the usage ledger (mixed into :class:`~hermes_modal_tool.pool.SandboxPool`).

Per lease: the wall time held and the tool calls (counted on the :class:`Slot`), and the
agent's measurement of CPU, memory and disk (``usage`` op, ``agent/limits/usage.py``). Per
pool: slot-seconds of live sandboxes against slot-seconds held, so that
``get_status()`` shows the warm time no trajectory used.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .errors import SandboxError
from .slots import Slot
from .usage import Usage, from_agent

if TYPE_CHECKING:
    from ._slot_record import SlotRecord
    from .sandbox import Sandbox

#: Seconds the agent has to answer a ``usage`` request (it walks the slot's layer).
USAGE_TIMEOUT_S = 30.0


class PoolUsage:
    """Needs the pool's ``config``, ``name`` and ``_sandboxes``; call :meth:`_usage_init`."""

    def _usage_init(self) -> None:
        self._slot_s_done = 0.0  # slot-seconds of sandboxes that ended
        self._held_s_done = 0.0  # seconds held by leases that ended

    def _sandbox_ended(self, sb: Sandbox) -> None:
        """Count a sandbox's slot-seconds once it is retired, dead or stopped."""
        if getattr(sb, "_usage_counted", False):
            return
        sb._usage_counted = True  # type: ignore[attr-defined]
        self._slot_s_done += (time.monotonic() - sb.started_at) * sb.slots

    def _has_gpu(self) -> bool:
        """Whether the profile's slots hold a GPU: a ``gpu`` on the Modal driver (the local
        driver ignores ``gpu`` today; where it binds GPUs, its agent says so in ``gpus``)."""
        return bool(self.config.gpu) and (self.config.driver == "modal"
                                          or bool(self.info.get("gpus")))  # type: ignore[attr-defined]

    def _lease_ended(self, slot: Slot) -> float:
        """The lease's wall time held (seconds), added to the pool's held total."""
        held = max(0.0, time.monotonic() - slot._held_since) if slot._held_since else 0.0
        self._held_s_done += held
        return held

    def _ask_usage(self, rec: SlotRecord | None, disk: bool = False) -> tuple[Any, str | None]:
        """Queue the ``usage`` request (written with the sandbox's next flush): the future
        of its reply, or None and why the agent is not asked."""
        if rec is None or rec.sandbox.dead:
            return None, "its sandbox ended: only the host's counts"
        _, fut = rec.sandbox.submit({"op": "usage", "slot": rec.index, "disk": disk},
                                    USAGE_TIMEOUT_S, flush=False)
        return fut, None

    async def _usage_of(self, asked: tuple[Any, str | None], slot: Slot, wall_s: float) -> Usage:
        """The :class:`Usage` from an :meth:`_ask_usage`; never raises for a dead or slow
        agent (then ``source="host"`` and why in ``notes``)."""
        fut, note = asked
        reply: dict[str, Any] | None = None
        if fut is not None:
            try:
                answer = await fut
            except SandboxError as exc:
                note = f"the agent was not asked: {exc}"
            else:
                if answer.get("ok") and isinstance(answer.get("result"), dict):
                    reply = answer["result"]
                else:
                    note = f"the agent could not measure it: {answer.get('error')}"
        return from_agent(reply, slot_id=slot.slot_id, trajectory_id=slot.trajectory_id,
                          profile=self.name, wall_s=wall_s, calls=slot._calls,
                          gpu=self._has_gpu(), note=note)

    async def _measure(self, rec: SlotRecord | None, slot: Slot, wall_s: float, disk: bool = False) -> Usage:
        """Ask the slot's agent what the tenant used (one round trip)."""
        asked = self._ask_usage(rec, disk)
        if rec is not None and asked[0] is not None:
            rec.sandbox.flush()
        return await self._usage_of(asked, slot, wall_s)

    async def _ended_lease_usage(self, slot: Slot) -> Usage | None:
        """The host's counts for a lease its sandbox ended (once: the slot is forgotten)."""
        if not slot._held_since:
            return None
        usage = await self._measure(None, slot, self._lease_ended(slot))
        slot._held_since = 0.0
        slot._sandbox = None
        return usage

    async def usage(self, slot: Slot, disk: bool = True) -> Usage:
        """What the slot's holder has used so far (see :class:`Usage`); ``disk``: measure
        the slot's layer too (a walk, linear in its files).

        Raises:
            UsageError: the slot is not held.
        """
        rec = self.record_of(slot)  # type: ignore[attr-defined]
        wall = max(0.0, time.monotonic() - slot._held_since) if slot._held_since else 0.0
        return await self._measure(rec, slot, wall, disk)

    def usage_status(self) -> dict[str, Any]:
        """Slot-seconds of the pool's sandboxes, seconds held by trajectories, and the
        difference: warm time no trajectory used (``unattributed_warm_s``)."""
        now = time.monotonic()
        live = sum((now - sb.started_at) * sb.slots for sb in self._sandboxes.values()
                   if not getattr(sb, "_usage_counted", False))
        held_now = sum(now - r.holder._held_since for recs in self._records.values()  # type: ignore[attr-defined]
                       for r in recs if r.holder is not None and r.holder._held_since)
        slot_s = self._slot_s_done + live
        held = self._held_s_done + held_now
        return {"slot_seconds": round(slot_s, 3), "held_seconds": round(held, 3),
                "unattributed_warm_s": round(max(0.0, slot_s - held), 3)}
