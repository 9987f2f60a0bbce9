"""The usage ledger: what one trajectory used while it held a slot.

``await backend.release(slot)`` returns a :class:`Usage`; ``await backend.usage(slot)``
gives one while the slot is held. The host counts the wall time held, the tool calls
and the GPU time (the wall time held, when the profile has a ``gpu``); the in-sandbox
agent measures CPU, memory and disk (``hermes_modal_tool/agent/limits/usage.py``): from the
slot's cgroup where it has one (``source`` ``"cgroup-v1"`` or ``"cgroup-v2"``), else
only what the agent can count (``"agent"``: CPU and memory None); ``"host"`` when the
agent could not be asked (its sandbox died), with only the host's counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

#: Fields summed by :func:`total_usage` (None counts as unknown: the sum says how many).
_SUMMED = ("wall_s", "cpu_user_s", "cpu_system_s", "disk_bytes", "gpu_s")
_MAXED = ("memory_peak_bytes", "disk_peak_bytes")


@dataclass(frozen=True)
class Usage:
    """What one trajectory used while it held a slot (one lease, from acquire to release).

    Attributes:
        slot_id: the slot held.
        trajectory_id: who held it.
        profile: the profile (pool) of the slot.
        source: where CPU, memory and disk come from: ``"cgroup-v1"``, ``"cgroup-v2"``
            (the slot's own cgroup), ``"agent"`` (no cgroup: CPU and memory None) or
            ``"host"`` (the sandbox could not be asked: only wall time and calls).
        wall_s: seconds the slot was held (acquire to release, host clock).
        cpu_user_s: CPU seconds in user mode of everything the slot ran (None: unknown).
        cpu_system_s: CPU seconds in kernel mode (None: unknown).
        memory_peak_bytes: the slot's peak memory (cgroup: processes and page cache).
        disk_bytes: bytes (blocks) the slot's writable layer (or workspace) held at the end.
        disk_peak_bytes: the largest that layer was seen (at the end and, with a
            ``slot_disk`` limit, every 0.5 s while commands ran).
        calls: tool calls made, by tool name (``{"bash": 3, "write_file": 1}``).
        gpu_s: seconds a GPU was held (``wall_s`` when the profile's slots have one: a
            ``gpu`` on the Modal driver), else None.
        notes: what could not be measured exactly, in words.
    """

    slot_id: str
    trajectory_id: str | None
    profile: str
    source: str
    wall_s: float
    cpu_user_s: float | None = None
    cpu_system_s: float | None = None
    memory_peak_bytes: int | None = None
    disk_bytes: int | None = None
    disk_peak_bytes: int | None = None
    calls: Mapping[str, int] = field(default_factory=dict)
    gpu_s: float | None = None
    notes: tuple[str, ...] = ()

    @property
    def cpu_s(self) -> float | None:
        """User plus system CPU seconds (None when unknown)."""
        if self.cpu_user_s is None or self.cpu_system_s is None:
            return None
        return self.cpu_user_s + self.cpu_system_s

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (``calls`` a plain dict, ``notes`` a list)."""
        out = asdict(self)
        out["calls"] = dict(self.calls)
        out["notes"] = list(self.notes)
        return out


def from_agent(reply: Mapping[str, Any] | None, *, slot_id: str, trajectory_id: str | None,
               profile: str, wall_s: float, calls: Mapping[str, int], gpu: bool,
               note: str | None = None) -> Usage:
    """A :class:`Usage` from the agent's ``usage`` answer (None: the agent was not asked
    or did not answer; ``note`` says why). Values that are not numbers become None
    (the agent runs next to untrusted code, but the answer is its own)."""
    got = dict(reply or {})

    def num(key: str, kind: type) -> Any:
        value = got.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        if not math.isfinite(value) or value < 0:
            return None
        return kind(value)

    notes = [str(n) for n in got.get("notes") or () if isinstance(n, str)]
    if note:
        notes.append(note)
    return Usage(
        slot_id=slot_id, trajectory_id=trajectory_id, profile=profile,
        source=str(got.get("source")) if reply is not None else "host",
        wall_s=round(wall_s, 6),
        cpu_user_s=num("cpu_user_s", float), cpu_system_s=num("cpu_system_s", float),
        memory_peak_bytes=num("memory_peak_bytes", int), disk_bytes=num("disk_bytes", int),
        disk_peak_bytes=num("disk_peak_bytes", int), calls=dict(calls),
        gpu_s=round(wall_s, 6) if gpu else None, notes=tuple(notes))


def total_usage(usages: Iterable[Usage | Mapping[str, Any]]) -> dict[str, Any]:
    """Sum a list of :class:`Usage` (or their ``as_dict()``): wall, CPU, disk and GPU
    seconds/bytes summed, memory and disk peaks their maximum, calls summed by tool,
    ``trajectories`` how many, ``unknown`` how many lacked each summed field."""
    out: dict[str, Any] = {k: 0.0 for k in _SUMMED}
    out.update({k: 0 for k in _MAXED})
    out.update({"trajectories": 0, "calls": {}, "unknown": {}, "sources": {}})
    for u in usages:
        d = u.as_dict() if isinstance(u, Usage) else dict(u)
        out["trajectories"] += 1
        src = str(d.get("source"))
        out["sources"][src] = out["sources"].get(src, 0) + 1
        for key in _SUMMED:
            if d.get(key) is None:
                out["unknown"][key] = out["unknown"].get(key, 0) + 1
            else:
                out[key] += d[key]
        for key in _MAXED:
            if d.get(key) is not None:
                out[key] = max(out[key], d[key])
        for tool, n in (d.get("calls") or {}).items():
            out["calls"][tool] = out["calls"].get(tool, 0) + n
    for key in ("wall_s", "cpu_user_s", "cpu_system_s", "gpu_s"):
        out[key] = round(out[key], 6)
    out["disk_bytes"] = int(out["disk_bytes"])
    return out
