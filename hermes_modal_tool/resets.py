"""Slot resets and the quarantine of a slot whose reset failed (mixed into SandboxPool).

A reset that fails (the agent could not empty the slot, or did not answer in time)
must not take the slot's neighbours down with it, and must not hand the slot to the
next tenant either: the slot is taken out of service, retried, and reported.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from .errors import SandboxDiedError, SandboxError

if TYPE_CHECKING:
    from ._slot_record import SlotRecord

log = logging.getLogger("hermes_modal_tool")

#: Seconds before each new reset of a quarantined slot (a slot whose reset failed).
QUARANTINE_RETRY_S = (2.0, 10.0, 30.0)
#: Seconds the agent has to answer a reset.
RESET_TIMEOUT_S = 60.0


class SlotResets:
    """Needs the pool's ``_records``, ``_sandboxes``, ``stats``, ``last_error``, ``_spawn``,
    ``_offer`` and ``_retire``."""

    async def _reset(self, rec: SlotRecord) -> None:
        sb = rec.sandbox
        try:
            reply = await sb.request({"op": "reset", "slot": rec.index}, RESET_TIMEOUT_S)
            if not reply.get("ok"):
                raise SandboxError(str(reply.get("error")))
        except SandboxDiedError:
            return
        except SandboxError as exc:
            self._quarantine(rec, exc)
            return
        refused = (reply.get("result") or {}).get("network_refused")  # network: egress
        if refused:
            self.stats["network_refused"] += int(refused.get("names", 0)) + int(refused.get("connections", 0))
        if rec.extra.pop("quarantine", None) is not None:
            log.warning("slot %s is back in service: its reset succeeded", rec.slot_id)
        rec.ready = True
        self._offer(rec)

    def _quarantine(self, rec: SlotRecord, exc: BaseException) -> None:
        """Take a slot whose reset failed out of service, keep its sandbox's other slots
        running, and retry the reset after each of ``QUARANTINE_RETRY_S``; after the last
        it stays out (reported in ``status()["quarantined_slots"]``) until its sandbox ends."""
        q = rec.extra.setdefault("quarantine", {"slot_id": rec.slot_id, "attempts": 0})
        if q["attempts"] == 0:
            self.stats["quarantined"] += 1
        q["attempts"] += 1
        q["error"] = str(exc)
        self.last_error = f"reset of {rec.slot_id} failed: {exc}"
        if q["attempts"] <= len(QUARANTINE_RETRY_S):
            delay = QUARANTINE_RETRY_S[q["attempts"] - 1]
            log.warning("reset of %s failed (%s); the slot is quarantined (its neighbours keep "
                        "running); retrying in %g s", rec.slot_id, exc, delay)
            self._spawn(self._retry_reset(rec, rec.lease, delay), f"hermes-modal-tool retry {rec.slot_id}")
            return
        q["gave_up"] = True
        log.error("reset of %s failed %d times (%s); the slot stays out of service until its "
                  "sandbox is replaced", rec.slot_id, q["attempts"], exc)
        recs = self._records.get(rec.sandbox.sandbox_id, [])
        if all(r.extra.get("quarantine", {}).get("gave_up") for r in recs):
            self._retire(rec.sandbox)  # nothing left in it to serve

    async def _retry_reset(self, rec: SlotRecord, lease: int, delay: float) -> None:
        await asyncio.sleep(delay)
        if rec.lease == lease and rec.holder is None and rec.sandbox.sandbox_id in self._sandboxes:
            await self._reset(rec)
