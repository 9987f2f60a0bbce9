"""Helpers the benchmarks share: quantiles and reading /proc (Linux)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of ``xs`` (0 <= q <= 1); NaN when empty."""
    s = sorted(xs)
    if not s:
        return math.nan
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in KiB."""
    out = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0])
    return out


def proc_stats() -> Iterator[tuple[int, list[str]]]:
    """``(pid, fields)`` for every process; fields start at the state (``/proc/PID/stat``
    after the command name)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        yield int(entry), stat[stat.rfind(")") + 2:].split()


def descendants(root: int, live_only: bool = False) -> list[int]:
    """Pids of every descendant of ``root`` (through /proc/*/stat ppids); zombies
    left out with ``live_only``."""
    children: dict[int, list[int]] = {}
    for pid, fields in proc_stats():
        if not (live_only and fields[0] == "Z"):
            children.setdefault(int(fields[1]), []).append(pid)
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux), so engine
    processes whose parent died come back to us: attributable, and reaped before we exit."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False
