"""``ToolBackend``'s status methods: ``get_status()`` and ``list_profiles()`` (a mixin)."""

from __future__ import annotations

from typing import Any

from .errors import UsageError
from .slots import Slot
from .usage import Usage


class StatusMethods:
    """Mixed into :class:`~hermes_modal_tool.backend.ToolBackend`: needs its ``_check_open``, ``_pools``,
    ``profiles``, ``default_profile``, ``_drivers``, ``_closed``, ``_snapshots`` and
    ``_setups``."""

    def get_status(self) -> dict[str, Any]:
        """A snapshot: totals over all pools plus ``pools[profile]`` details.

        Keys include ``sandboxes``, ``healthy_sandboxes`` (running, not dead),
        ``max_sandboxes`` (summed over the profiles; one profile: its own),
        ``total_slots``, ``available_slots``, ``acquired_slots``,
        ``slots_per_sandbox`` (of the default profile, else the first),
        ``default_profile``, ``profiles``, ``active_pools``,
        ``waiting_acquires``, ``calls_per_second``, ``failures``, ``quarantined_slots``
        (slots out of service because their reset failed: ``slot_id``, ``error``,
        ``attempts``, ``gave_up``; see ``resets.py``), ``snapshots`` (each live snapshot:
        id, profile, sandboxes holding a copy, ``size_bytes``, ``holders``), and per pool
        the isolation and limit mode (``cgroup-v1``, ``cgroup-v2`` or ``rlimit``);
        ``network_refused``: names answered NXDOMAIN and connections refused by the
        ``network: egress`` policy, counted for each tenant when its slot is released.
        Secret values never appear here.
        """
        pools = {name: pool.status() for name, pool in self._pools.items()}
        total = {k: sum(p[k] for p in pools.values()) for k in
                 ("sandboxes", "healthy_sandboxes", "total_slots", "available_slots",
                  "acquired_slots", "waiting_acquires", "calls", "failures", "timeouts", "quarantined",
                  "network_refused")}
        main = self.profiles.get(self.default_profile) or next(iter(self.profiles.values()))
        return {
            **total,
            "max_sandboxes": sum(p.max_sandboxes for p in self.profiles.values()),
            "calls_per_second": round(sum(p["calls_per_second"] for p in pools.values()), 2),
            "slots_per_sandbox": main.slots_per_sandbox,
            "default_profile": self.default_profile,
            "profiles": list(self.profiles),
            "active_pools": list(self._pools),
            "drivers": {name: d.describe() for name, d in self._drivers.items()},
            "closed": self._closed,
            "quarantined_slots": [q for p in pools.values() for q in p["quarantined_slots"]],
            "snapshots": self._snapshots.status(),
            "setups": self._setups.status(),
            "pools": pools,
        }

    async def usage(self, slot: Slot, disk: bool = True) -> Usage:
        """What the slot's holder has used so far (a :class:`Usage`, as ``release`` returns);
        ``disk``: measure the slot's layer too (a walk of its files, in a worker thread).

        Raises:
            UsageError: the slot is not held (released, its sandbox gone, not a Slot).
            BackendClosedError: after ``stop()``.
        """
        if not isinstance(slot, Slot):
            raise UsageError(f"usage() takes a Slot, got {type(slot).__name__}")
        self._check_open()  # type: ignore[attr-defined]
        pool = self._pools.get(slot.profile)
        if pool is None:
            raise UsageError(f"slot {slot.slot_id} does not belong to this backend")
        return await pool.usage(slot, disk)

    def list_profiles(self) -> dict[str, dict[str, Any]]:
        """Each profile's main settings and whether its pool is running."""
        return {
            name: {"driver": p.driver, "image": p.image, "gpu": p.gpu, "cpu": p.cpu, "memory": p.memory,
                   "slots_per_sandbox": p.slots_per_sandbox, "min_sandboxes": p.min_sandboxes,
                   "max_sandboxes": p.max_sandboxes, "network": p.network,
                   "secrets": list(p.secrets), "active": name in self._pools}
            for name, p in self.profiles.items()
        }
