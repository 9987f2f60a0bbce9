"""What ``get_status()`` shows of one pool (a part of :class:`~hermes_modal_tool.pool.SandboxPool`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from .gpus import gpu_status

log = logging.getLogger("hermes_modal_tool")
_WARNED_WORKSPACE_ONLY: set[str] = set()  # profiles already warned about (once per process)
_WARNED_NO_NETWORK: set[str] = set()
#: ``calls_per_second``: calls are counted per tenth of a second, for the last minute.
RATE_TICKS_PER_S = 10
RATE_KEEP_S = 60.0


class PoolStatus:
    """Mixed into the pool: needs its ``config``, ``info``, ``stats``, ``last_error``,
    ``_records``, ``_sandboxes``, ``_free``, ``_waiters``, ``_starting``, ``_live`` and
    ``_rate_window``."""

    def _warn_degraded(self) -> None:
        """Say once per profile when slots could not get a layered root of their own, or
        the default ``network: egress`` became ``none`` (agent/net/slotnet.start_or_degrade)."""
        if self.info.get("network_note") and self.name not in _WARNED_NO_NETWORK:
            _WARNED_NO_NETWORK.add(self.name)
            log.warning("profile %r: %s", self.name, self.info["network_note"])
        if (self.info.get("filesystem") == "workspace-only" and self.config.filesystem == "auto"
                and self.name not in _WARNED_WORKSPACE_ONLY):
            _WARNED_WORKSPACE_ONLY.add(self.name)
            log.warning("profile %r: slots are workspace-only (no private root filesystem: %s); "
                        "only the workspace is writable and slots are not root. Set "
                        "filesystem: workspace-only to silence this.", self.name,
                        self.info.get("filesystem_note") or "unknown reason")

    def calls_per_second(self, window: float = 10.0) -> float:
        """Calls sent in the last ``window`` seconds (at most :data:`RATE_KEEP_S`), per
        second, counted in tenths of a second (:meth:`_count_call`)."""
        now = int(time.monotonic() * RATE_TICKS_PER_S)
        span = min(window, RATE_KEEP_S) * RATE_TICKS_PER_S
        return sum(n for tick, n in self._rate_window if now - tick < span) / window

    def _new_rate_tick(self, tick: int) -> None:
        """Start counting calls in ``tick`` (pool.submit counts into the last one itself:
        one comparison and one add per call, and the counts keep :data:`RATE_KEEP_S`
        seconds, not one entry per call until someone asks for the status)."""
        w = self._rate_window
        w.append([tick, 1])
        while tick - w[0][0] > RATE_KEEP_S * RATE_TICKS_PER_S:
            w.popleft()

    def status(self) -> dict[str, Any]:
        total = sum(len(r) for r in self._records.values())
        held = sum(1 for recs in self._records.values() for r in recs if r.holder is not None)
        quarantined = [dict(r.extra["quarantine"]) for recs in self._records.values()
                       for r in recs if "quarantine" in r.extra and r.holder is None]
        return {
            "driver": self.config.driver,
            "sandboxes": self._live(),
            "healthy_sandboxes": sum(1 for s in self._sandboxes.values() if not s.dead),
            "starting_sandboxes": self._starting,
            "min_sandboxes": self.config.min_sandboxes,
            "max_sandboxes": self.config.max_sandboxes,
            "slots_per_sandbox": self.config.slots_per_sandbox,
            "total_slots": total,
            "available_slots": len(self._free),
            "acquired_slots": held,
            "resetting_slots": total - held - len(self._free) - len(quarantined),
            "waiting_acquires": sum(1 for w in self._waiters if not w.done()),
            "quarantined_slots": quarantined,
            "calls_per_second": round(self.calls_per_second(), 2),
            "isolation": self.info.get("isolation", self.config.isolation),
            "filesystem": self.info.get("filesystem"),
            "filesystem_note": self.info.get("filesystem_note") or None,
            "slot_disk": self.info.get("slot_disk"),
            "caps": self.info.get("caps"),
            "limits": self.info.get("limits"),
            "limits_note": self.info.get("limits_note") or None,
            "abstract_sockets": self.info.get("abstract_sockets"),
            # "none" where the default egress could not start (network_note says why)
            "network": "none" if self.info.get("network_note") else self.config.network,
            "network_note": self.info.get("network_note") or None,
            "gpu": gpu_status(self.config, self._sandboxes),
            "volumes": [v.model_dump() for v in self.config.volumes],
            **self.stats,
            "usage": self.usage_status(),
            "last_error": self.last_error,
        }
