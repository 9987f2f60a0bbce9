"""Section f of ``benchmarks/engine.py``: shells per second at fresh slots, and where a
shell start's CPU goes, beside two floors measured in the same run: ``bwrap ... true``
(starts that end at once) and the same shells' processes without the agent (bwrap with a
slot's options and bash, kept running as slots' shells are).

CPU is counted per process: for the agents (and their spawners) the growth over the
batch of ``/proc/PID/stat``'s ``utime + stime`` (every thread, ended ones included) and
``cutime + cstime`` (reaped children), in clock ticks; for each shell's processes
(``bwrap``, the slot's init, ``bash``: single-threaded, all started in the batch) their
whole life so far from ``/proc/PID/schedstat`` (nanoseconds; ``stat`` rounds their 1-2
ms down to 0 ticks). The machine's busy time (``/proc/stat``) is the total; what no
process of ours accounts for is "other" (kernel threads, this benchmark's own process).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from _proc import TICK, busy_cpu_s, descendants, proc_kind, proc_stats, schedstat_s

from hermes_modal_tool.drivers.local import BASE_PATH

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
        after_s, c2 = await _settle(c1)
        m2 = busy_cpu_s()
        for s in ss:
            await b.release(s)
    finally:
        await b.stop()
    split = _split(c0, c1, slots)
    machine_ms = (m1 - m0) * 1e3 / slots
    split["other"] = machine_ms - sum(split.values())
    return {"slots": slots, "sandboxes": sandboxes, "wall_s": wall, "shells_per_s": slots / wall,
            "failed": failed, "machine_cpu_ms_per_shell": machine_ms, "cpu_ms_per_shell": split,
            "after_s": after_s, "after_cpu_ms_per_shell": sum(_split(c1, c2, slots).values()),
            "after_machine_cpu_ms_per_shell": (m2 - m1) * 1e3 / slots}


async def _settle(start: dict[int, tuple[str, float]], limit: float = 30.0,
                  idle_ms: float = 5.0) -> tuple[float, dict[int, tuple[str, float]]]:
    """After the batch: wait until our processes use under ``idle_ms`` of CPU per 0.25 s,
    two readings running (at most ``limit`` seconds): the work the agents put off while
    the batch kept the CPU busy (the slots' standby layers, agent/limits/quiet.py). Returns the
    seconds until then and the last :func:`cpu_by_pid` reading."""
    t0, last, calm = perf(), start, 0
    while perf() - t0 < limit and calm < 2:
        await asyncio.sleep(0.25)
        now = cpu_by_pid()
        calm = calm + 1 if sum(_split(last, now, 1).values()) < idle_ms else 0
        last = now
    return perf() - t0, last


def _start_rate(one: Callable[[int], Any], n: int, parallel: int, warm: int) -> tuple[list[Any], dict[str, Any]]:
    """``one(i)`` for ``i`` in ``range(n)``, ``parallel`` at a time, after ``warm`` calls
    that are not timed: their results, and starts per second and the machine's CPU per
    start (the starting threads' ``fork``/``exec`` included) as the floors report them."""
    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(one, range(warm)))
        m0, t0 = busy_cpu_s(), perf()
        results = list(pool.map(one, range(n)))
        wall, m1 = perf() - t0, busy_cpu_s()
    return results, {"n": n, "parallel": parallel, "per_s": n / wall,
                     "machine_cpu_ms_per_start": (m1 - m0) * 1e3 / n}


def bwrap_true_rate(bwrap: str, n: int, parallel: int) -> dict[str, Any]:
    """Start ``n`` ``bwrap --unshare-user --unshare-pid ... true``, ``parallel`` at a time:
    sandboxes per second (the floor of starting slot shells), and the machine's CPU per
    start (the starting thread's ``fork``/``exec`` included)."""
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--ro-bind", "/", "/", "--proc", "/proc",
            "--dev", "/dev", "true"]

    def one(_: int) -> int:
        return subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              check=False).returncode

    codes, rate = _start_rate(one, n, parallel, warm=min(n, parallel))
    return {**rate, "failed": sum(c != 0 for c in codes)}


#: A slot shell's bwrap options (agent/limits/isolation.py: ``bwrap_root_argv``, whose own
#: argv cannot serve here: it binds the control directory at ``/run/hmt``, which on the
#: host's root would make that directory on the host), its root the host's, read-only.
_SHELL_OPTIONS = ["--unshare-user", "--uid", "0", "--gid", "0", "--cap-add", "ALL", "--unshare-pid",
                  "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent",
                  "--new-session", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev",
                  "--size", "268435456", "--tmpfs", "/dev/shm", "--chdir", "/"]
_SHELL_ENV = {"PATH": BASE_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "dumb", "HOME": "/root"}


def live_shells_rate(bwrap: str, n: int, parallel: int) -> dict[str, Any]:
    """The processes of ``n`` slot shells without the agent: ``bwrap`` with a slot's
    options (on the host's root, read-only: no overlay, cgroups or uid of its own) and
    ``bash --noprofile --norc`` answering a first line, ``parallel`` started at a time
    and all kept running until the last has answered, as slots' shells are. Shells per
    second, and the machine's CPU per shell."""
    argv = [bwrap, *_SHELL_OPTIONS, "bash", "--noprofile", "--norc"]
    procs: list[subprocess.Popen] = []

    def one(_: int) -> bool:
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, env=_SHELL_ENV)
        procs.append(p)
        p.stdin.write(b"echo ready\n")
        p.stdin.flush()
        return p.stdout.readline() == b"ready\n"

    try:
        ok, rate = _start_rate(one, n, parallel, warm=0)
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            p.wait()
            p.stdout.close()
    return {**rate, "failed": ok.count(False)}
