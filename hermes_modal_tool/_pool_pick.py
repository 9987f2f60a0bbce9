"""Which free slot ``acquire`` leases (a part of :class:`~hermes_modal_tool.pool.SandboxPool`)."""

from __future__ import annotations

from typing import Any

#: How many of the last released free slots ``acquire`` chooses from (the oldest of them).
PICK_WINDOW = 8


class SlotPick:
    """Mixed into the pool: needs its ``config``, ``_free`` (free records, last released
    last), ``_sandboxes`` (live ones by id) and ``_held`` (sandbox id -> leased slots)."""

    def _take_free(self) -> Any:
        # Of the PICK_WINDOW slots released last, the one released first: busy sandboxes stay
        # busy (idle ones can be stopped) and the agent has had the most time to start its
        # next shell (after a reset; a new sandbox's from slot_0 up): it is likely ready.
        # With config.spread and several sandboxes live, the same among the free slots of
        # the sandbox holding the fewest leased slots (_take_spread).
        free = self._free
        if self.config.spread and len(self._sandboxes) > 1 and free:
            return self._take_spread()
        while free:
            best = None
            for pos in range(len(free) - 1, max(-1, len(free) - 1 - PICK_WINDOW), -1):
                rec = free[pos]
                if rec.sandbox.dead or rec.sandbox.sandbox_id not in self._sandboxes:
                    continue
                if best is None or rec.offered < free[best].offered:
                    best = pos
            if best is not None:
                rec = free[best]
                del free[best]
                return rec
            for _ in range(min(PICK_WINDOW, len(free))):
                free.pop()  # gone with their sandboxes
        return None

    def _take_spread(self) -> Any:
        """A free slot of the live sandbox that holds the fewest leased slots: each
        sandbox's agent serves its slots on one thread (one core), so slots spread over
        the live sandboxes use as many cores as there are sandboxes. Among that sandbox's
        free slots, as :meth:`_take_free` picks. The scan stops at the first PICK_WINDOW
        free slots of a sandbox holding the fewest of all (the common case, and O(1) in the
        number of sandboxes besides the minimum), else reads the whole free list once."""
        free, live, held = self._free, self._sandboxes, self._held
        low = min(held.get(sid, 0) for sid in live)
        best_pos, best_key, seen = -1, None, 0
        for pos in range(len(free) - 1, -1, -1):
            rec = free[pos]
            sb = rec.sandbox
            if sb.dead or sb.sandbox_id not in live:
                continue
            key = (held.get(sb.sandbox_id, 0), rec.offered)
            if best_key is None or key < best_key:
                best_pos, best_key = pos, key
            if key[0] == low:
                seen += 1
                if seen >= PICK_WINDOW:
                    break
        if best_key is None:
            free.clear()  # every free slot went with its sandbox
            return None
        rec = free[best_pos]
        del free[best_pos]
        return rec
