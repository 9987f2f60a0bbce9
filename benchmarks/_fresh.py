"""Section f of ``benchmarks/engine.py``: shells per second at fresh slots, and where a
shell start's CPU goes, beside the ``bwrap ... true`` floor measured in the same run.

CPU is counted per process: for the agents (and their spawners) the growth over the
batch of ``/proc/PID/stat``'s ``utime + stime`` (every thread, ended ones included) and
``cutime + cstime`` (reaped children), in clock ticks; for each shell's processes
(``bwrap``, the slot's init, ``bash``: single-threaded, all started in the batch) their
whole life so far from ``/proc/PID/schedstat`` (nanoseconds; ``stat`` rounds their 1-2
ms down to 0 ticks). The machine's busy time (``/proc/stat``) is the total; what no
process of ours accounts for is "other" (kernel threads, this benchmark's own process).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from _proc import TICK, busy_cpu_s, descendants, proc_kind, proc_stats, schedstat_s

perf = time.perf_counter


def cpu_by_pid() -> dict[int, tuple[str, float]]:
    """``{pid: (kind, CPU seconds so far)}`` of every live descendant of this process (its
    threads, dead or alive, and its reaped children included; kinds as ``proc_kind``)."""
    mine = set(descendants(os.getpid(), live_only=True))
    return {pid: (proc_kind(pid), max(sum(int(x) for x in fields[11:15]) / TICK, schedstat_s(pid) or 0.0))
            for pid, fields in proc_stats() if pid in mine}


def _split(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
           n: int) -> dict[str, float]:
    """CPU ms per shell by process kind between two :func:`cpu_by_pid` readings."""
    out: dict[str, float] = {}
    for pid, (kind, cpu) in after.items():
        if kind != "gone":
            out[kind] = out.get(kind, 0.0) + (cpu - before.get(pid, (kind, 0.0))[1]) * 1e3 / n
    return out


async def fresh_shells(make_backend: Callable[[int, int], Awaitable[Any]], slots: int,
                       per_sandbox: int) -> dict[str, Any]:
    """The first ``true`` in ``slots`` fresh slots at once (each starts its shell).

    ``make_backend(slots_per_sandbox, sandboxes)`` returns a started ToolBackend."""
    sandboxes = -(-slots // per_sandbox)
    b = await make_backend(per_sandbox, sandboxes)
    try:
        ss = [await b.acquire(f"f{i}") for i in range(slots)]
        c0, m0 = cpu_by_pid(), busy_cpu_s()
        t0 = perf()
        rs = await b.execute_batch([(s, "bash", {"command": "true"}) for s in ss])
        wall = perf() - t0
        c1, m1 = cpu_by_pid(), busy_cpu_s()
        failed = sum(not r.success for r in rs)
        for s in ss:
            await b.release(s)
    finally:
        await b.stop()
    split = _split(c0, c1, slots)
    machine_ms = (m1 - m0) * 1e3 / slots
    split["other"] = machine_ms - sum(split.values())
    return {"slots": slots, "sandboxes": sandboxes, "wall_s": wall, "shells_per_s": slots / wall,
            "failed": failed, "machine_cpu_ms_per_shell": machine_ms, "cpu_ms_per_shell": split}


def bwrap_true_rate(bwrap: str, n: int, parallel: int) -> dict[str, Any]:
    """Start ``n`` ``bwrap --unshare-user --unshare-pid ... true``, ``parallel`` at a time:
    sandboxes per second (the floor of starting slot shells), and the machine's CPU per
    start (the starting thread's ``fork``/``exec`` included)."""
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--ro-bind", "/", "/", "--proc", "/proc",
            "--dev", "/dev", "true"]

    def one(_: int) -> int:
        return subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              check=False).returncode

    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(one, range(min(n, parallel))))  # warm
        m0, t0 = busy_cpu_s(), perf()
        codes = list(pool.map(one, range(n)))
        wall, m1 = perf() - t0, busy_cpu_s()
    return {"n": n, "parallel": parallel, "per_s": n / wall, "failed": sum(c != 0 for c in codes),
            "machine_cpu_ms_per_start": (m1 - m0) * 1e3 / n}
