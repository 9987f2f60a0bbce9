"""Helpers the benchmarks share: quantiles and reading /proc (Linux)."""

from __future__ import annotations

import math
import os
import time
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


def proc_state(pid: int) -> str:
    """The state letter of ``pid`` (``R``, ``S``, ``Z``...); ``?`` once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return "?"
    return stat[stat.rfind(")") + 2:].split()[0]


def proc_kind(pid: int) -> str:
    """agent / bwrap (outer) / bwrap-init (pid 1 of a slot) / bash / other."""
    try:
        with open(f"/proc/{pid}/comm") as fh:
            comm = fh.read().strip()
        with open(f"/proc/{pid}/status") as fh:
            status = fh.read()
    except OSError:
        return "gone"
    nspid = next((ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid:")), [])
    if comm == "bwrap":
        return "bwrap-init" if len(nspid) > 1 and nspid[-1] == "1" else "bwrap"
    if comm.startswith("python"):
        return "agent"
    return comm


# -- memory and CPU of our descendants, by kind (engine.py, run_all.py, load.py) ---------------

def pss_kib(pid: int) -> tuple[int, int]:
    """(Pss, Rss) of one process in KiB, from smaps_rollup."""
    pss = rss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1])
    except OSError:
        pass
    return pss, rss


def process_memory() -> dict[str, dict[str, int]]:
    """PSS/RSS (KiB) and counts of our descendant processes, by kind."""
    by: dict[str, dict[str, int]] = {}
    for pid in descendants(os.getpid()):
        kind = proc_kind(pid)
        if kind == "gone" or proc_state(pid) == "Z":
            continue
        pss, rss = pss_kib(pid)
        d = by.setdefault(kind, {"count": 0, "pss_kib": 0, "rss_kib": 0})
        d["count"] += 1
        d["pss_kib"] += pss
        d["rss_kib"] += rss
    return by


#: CPU seconds this process spent reading /proc for cpu_by_kind (left out of "host").
_WALKS_S = [0.0]


def host_cpu_s(walk_started: float) -> float:
    """This process's CPU seconds so far less every cpu_by_kind walk's, the one begun at
    ``walk_started`` (a ``time.process_time()``) included: a walk reads a few files per
    descendant (tens of ms with a hundred shells), and counted in "host" it added about
    7 µs to every call of a 128-slot round (section s, measured)."""
    now = time.process_time()
    _WALKS_S[0] += now - walk_started
    return now - _WALKS_S[0]


def cpu_by_kind() -> dict[str, float]:
    """CPU seconds so far of this process ("host", less these walks: :func:`host_cpu_s`)
    and of live descendants by kind.

    Descendants are read from ``/proc/PID/schedstat`` (nanoseconds; ``/proc/PID/stat``
    counts 10 ms ticks, too coarse for a hundred shells using a few ms each).
    """
    started = time.process_time()
    out: dict[str, float] = {}
    for pid in descendants(os.getpid()):
        kind = proc_kind(pid)
        cpu = schedstat_s(pid)
        if cpu is not None:
            out[kind] = out.get(kind, 0.0) + cpu
    out["host"] = host_cpu_s(started)
    return out


# -- CPU accounting for one measured step (added for modal_rpc.py) ---------------------------

TICK = os.sysconf("SC_CLK_TCK")


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent not idle (``/proc/stat``)."""
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / TICK


def tree_cpu_s(root: int) -> float:
    """CPU seconds of process ``root`` (all its threads), of its reaped children, and of its
    live descendants (``/proc/PID/schedstat``, nanoseconds)."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system if root == os.getpid() else 0.0
    for pid in descendants(root, live_only=True) + ([] if root == os.getpid() else [root]):
        total += schedstat_s(pid) or 0.0
    return total


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid``, all its threads, those that ended
    included (``/proc/PID/stat``, clock ticks); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each live thread of process ``pid``, by thread id
    (``/proc/PID/task/TID/schedstat``, nanoseconds); empty once it is gone."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                out[int(tid)] = int(fh.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return out


def schedstat_s(pid: int) -> float | None:
    """CPU seconds of ``pid``'s main thread (``/proc/PID/schedstat``, nanoseconds: exact,
    where ``/proc/PID/stat`` rounds down to clock ticks); None once it is gone."""
    try:
        with open(f"/proc/{pid}/schedstat") as fh:
            return int(fh.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def others_cpu() -> dict[tuple[int, str], float]:
    """CPU seconds so far of every process outside this process tree, keyed by (pid, start)."""
    mine = set(descendants(os.getpid())) | {os.getpid()}
    out = {}
    for pid, fields in proc_stats():
        if pid in mine:
            continue
        try:
            with open(f"/proc/{pid}/schedstat") as fh:
                out[(pid, fields[19])] = int(fh.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return out


class CpuStep:
    """Wall time of a step and the cores busy outside this process tree meanwhile.

    ``with CpuStep("label") as step: ...`` then ``step.result()``: ``wall_s``, ``own_cpu_s``
    (this process and its descendants) and the cores busy elsewhere per second of wall time,
    as bounds: ``other_cores_low`` counts processes alive at both ends, ``other_cores``
    (the upper bound) is the machine's busy time minus ours (it also counts processes that
    came and went, and descendants of ours that exited unreaped).
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.wall_s = self.own_cpu_s = self.other_cpu_s = self.other_low_s = math.nan

    def __enter__(self) -> CpuStep:
        self._others0 = others_cpu()
        self._t0, self._busy0 = time.perf_counter(), busy_cpu_s()
        self._own0 = tree_cpu_s(os.getpid())
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._t0
        busy = busy_cpu_s() - self._busy0
        self.own_cpu_s = min(max(0.0, tree_cpu_s(os.getpid()) - self._own0), busy)
        self.other_cpu_s = busy - self.own_cpu_s
        others = others_cpu()
        self.other_low_s = min(self.other_cpu_s, sum(
            max(0.0, v - self._others0[k]) for k, v in others.items() if k in self._others0))

    def result(self) -> dict[str, float | str]:
        wall = self.wall_s or math.nan
        return {"step": self.label, "wall_s": self.wall_s, "own_cpu_s": self.own_cpu_s,
                "other_cpu_s": self.other_cpu_s, "other_cores": self.other_cpu_s / wall,
                "other_cores_low": self.other_low_s / wall, "own_cores": self.own_cpu_s / wall}
