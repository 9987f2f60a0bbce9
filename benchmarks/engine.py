"""Engine benchmark: our slot engine vs SWE-ReX's LocalRuntime vs ``subprocess.run``.

Measured in one run, side by side:

a. warm ``echo`` round trip on one slot (median / p90 / p99 ms);
b. throughput: 100 slots x 100 trivial commands (rounds of ``execute_batch`` and one
   big batch), against parallel ``subprocess.run`` and parallel SWE-ReX sessions;
c. ``acquire`` + ``release(reset_workspace=True)`` (with and without one command);
d. cold start: a pool with ``min_sandboxes=1`` to ready, an extra sandbox started by
   pool growth, and the first command in a fresh slot (the bwrap spawn);
e. idle memory per live slot (``--slots``, default 1000): MemAvailable delta and the
   summed PSS of every engine process, divided by the number of slots;
f. shells per second: the first ``true`` in 1,000 fresh slots (10 sandboxes x 100; every
   slot starts its shell), against ``bwrap ... true`` started as fast as the machine allows
   and against the same shells' processes without the agent (bwrap with a slot's options
   and bash answering a first line, all kept running), with the CPU a shell takes by
   process kind beside the CPU of one such start, and the CPU of the work the agents put
   off until the batch was over (standby layers, ``_fresh.py``);
g. live output (``streaming.py``): one slot's streaming throughput against ``subprocess``
   reading the same ``head -c 100MB /dev/zero``, and a neighbour's ``echo`` while a slot
   of the same sandbox streams ``yes``.

Floors measured beside (``_floors.py``): a raw persistent bash answering ``echo`` (a), raw
persistent bashes answering trivial commands in rounds, bare and each in a memory, pids and
cpu cgroup of its own as a slot's shell is (b); bwrap starts and live shells per second (f,
in ``_fresh.py``).

Usage::

    .venv/bin/python benchmarks/engine.py            # full run (~1.5 minutes on 2 cores)
    .venv/bin/python benchmarks/engine.py --quick    # small, fast run (~20 s)
    .venv/bin/python benchmarks/engine.py --slots 500 --json /tmp/bench.json
    .venv/bin/python benchmarks/engine.py --wait-idle 300   # on a shared machine

Every backend uses a profile name unique to this run (sandbox ids, and so cgroup
names, derive from it), and the process makes itself a child subreaper so that engine
processes orphaned by kills come back to it: the final check then tells exactly what
this run left behind. The CPU used by other processes during each step is printed,
since anything else running on the machine skews the numbers. Exit status 1 means
something was left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hermes_modal_tool import SandboxConfig, ToolBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared benchmark helpers
import streaming  # noqa: E402 - section g
from _engine_render import render, summary_ms  # noqa: E402
from _floors import raw_bash_echo, raw_bash_throughput  # noqa: E402
from _fresh import bwrap_true_rate, fresh_shells, live_shells_rate  # noqa: E402 - section f
from _peers import (  # noqa: E402 - the peers we compare with (run_all.py uses them from here)
    _swerex_imports,
    latency_subprocess,
    latency_swerex,
    throughput_subprocess_asyncio,
    throughput_subprocess_threads,
    throughput_swerex_gather,
    throughput_swerex_threads,
)
from _proc import (  # noqa: E402
    become_subreaper,
    busy_cpu_s,
    descendants,
    meminfo,
    others_cpu,
    proc_kind,
    proc_stats,
    quantile,
    schedstat_s,
)

perf = time.perf_counter



# -- small helpers -------------------------------------------------------------------
def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return "?"
    return stat[stat.rfind(")") + 2:].split()[0]


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
        if kind == "gone" or _state(pid) == "Z":
            continue
        pss, rss = pss_kib(pid)
        d = by.setdefault(kind, {"count": 0, "pss_kib": 0, "rss_kib": 0})
        d["count"] += 1
        d["pss_kib"] += pss
        d["rss_kib"] += rss
    return by


ORPHANS: dict[str, int] = {"zombie": 0, "live": 0}


def reap_orphans() -> dict[str, list[int]]:
    """Our direct children that are not the agents we started: orphans re-parented to us.
    Zombies among them are reaped; live ones are reported (a leak)."""
    zombies, live = [], []
    for pid, f in proc_stats():
        if int(f[1]) != os.getpid():
            continue
        if f[0] == "Z":
            zombies.append(pid)
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        else:
            live.append(pid)
    return {"zombie": zombies, "live": live}


def _ours(pid: int) -> bool:
    """Whether a process belongs to this run's sandboxes (its cgroup names our profile)."""
    try:
        with open(f"/proc/{pid}/cgroup") as fh:
            return f"{PROFILE}-" in fh.read()  # cgroup "[<state dir>-]<profile>-<n>"
    except OSError:
        return False


def cpu_by_kind() -> dict[str, float]:
    """CPU seconds so far of this process ("host") and of live descendants by kind.

    Descendants are read from ``/proc/PID/schedstat`` (nanoseconds; ``/proc/PID/stat``
    counts 10 ms ticks, too coarse for a hundred shells using a few ms each).
    """
    out: dict[str, float] = {}
    for pid in descendants(os.getpid()):
        kind = proc_kind(pid)
        cpu = schedstat_s(pid)
        if cpu is not None:
            out[kind] = out.get(kind, 0.0) + cpu
    out["host"] = time.process_time()
    return out


def leftovers() -> dict[str, Any]:
    """What this run left behind: processes (``pgrep -f bwrap``), state dirs, cgroups.

    ``pgrep`` sees the whole machine; on a shared machine other users' sandboxes show
    up there too, so ours are told apart by cgroup (and by being our descendants).
    """
    pids = subprocess.run(["pgrep", "-f", "bwrap"], capture_output=True, text=True).stdout.split()
    live, zombie = [], []
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        state = stat[stat.rfind(")") + 2:].split()[0]
        (zombie if state == "Z" else live).append(int(p))
    mine = [p for p in descendants(os.getpid()) if proc_kind(p) != "gone"]
    ours_live = sorted(set([p for p in live if _ours(p)] + [p for p in mine if p in live]))
    cgroups = []
    for root in ("/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids", "/sys/fs/cgroup/cpu", "/sys/fs/cgroup/unified",
                 "/sys/fs/cgroup"):
        try:
            cgroups += [os.path.join(root, "hermes-modal-tool", e)
                        for e in os.listdir(os.path.join(root, "hermes-modal-tool")) if f"{PROFILE}-" in e]
        except OSError:
            pass
    orphans = reap_orphans()
    ORPHANS["zombie"] += len(orphans["zombie"])
    ORPHANS["live"] = len(orphans["live"])
    return {"pgrep_bwrap_live": live, "pgrep_bwrap_zombie": zombie, "our_bwrap_live": ours_live,
            "orphans_reaped": ORPHANS["zombie"], "orphans_live": orphans["live"],
            "our_descendants": mine, "our_state_dirs": [d for d in OWN_PATHS if os.path.exists(d)],
            "our_cgroups": sorted(set(cgroups))}


def wait_clean(timeout: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        left = leftovers()
        clean = not (left["our_bwrap_live"] or left["our_descendants"] or left["our_state_dirs"]
                     or left["our_cgroups"] or left["orphans_live"])
        left["clean"] = clean
        if clean or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def machine() -> dict[str, Any]:
    mem = meminfo()
    try:
        from hermes_modal_tool.drivers.local import find_bwrap
        bwrap = find_bwrap()
        bver = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout.strip()
    except Exception as exc:  # noqa: BLE001 - informational only
        bwrap, bver = None, f"unavailable ({exc})"
    try:
        from importlib.metadata import version
        swerex = version("swe-rex")
    except Exception:  # noqa: BLE001
        swerex = None
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty"],
                                capture_output=True, text=True).stdout.strip() or None
    except OSError:
        commit = None
    return {"nproc": len(os.sched_getaffinity(0)), "cpu": model, "commit": commit,
            "mem_total_gib": round(mem["MemTotal"] / 1024 / 1024, 1),
            "kernel": platform.release(), "python": sys.version.split()[0],
            "bwrap": bwrap, "bwrap_version": bver, "swe_rex": swerex, "euid": os.geteuid()}


#: A profile name unique to this run. Sandbox ids, and so the agents' cgroup names, derive
#: from it: up to commit 893c51b two backends on one host both named their cgroups
#: "default-0", and one backend's reset/stop killed the other's slots.
PROFILE = f"bench{os.getpid()}"
#: State directories of every driver this run created (checked at the end).
OWN_PATHS: list[str] = []
#: Facts the started backends report (limit mode: cgroup-v1/v2 or rlimit).
FACTS: dict[str, Any] = {}


def cfg(**kw: Any) -> SandboxConfig:
    base = {"name": PROFILE, "slots_per_sandbox": 100, "min_sandboxes": 1, "max_sandboxes": 1,
            "execution_timeout_s": 60}
    base.update(kw)
    return SandboxConfig(**base)


def track(b: ToolBackend) -> None:
    """Remember the state directories of ``b``'s drivers for the leak check."""
    for d in getattr(b, "_drivers", {}).values():
        for attr in ("state_root", "ctl_root"):
            path = getattr(d, attr, None)
            if path is not None and str(path) not in OWN_PATHS:
                OWN_PATHS.append(str(path))


async def started(config: SandboxConfig) -> ToolBackend:
    """A started backend (stopped again if start fails), tracked for the leak check."""
    b = ToolBackend(config)
    try:
        await b.start()
    except BaseException:
        await b.stop()
        raise
    finally:
        track(b)
    pool = b.get_status()["pools"].get(config.name, {})
    FACTS.setdefault("limits", pool.get("limits"))
    FACTS.setdefault("isolation", pool.get("isolation"))
    return b


def log(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


# -- a. latency --------------------------------------------------------------------------
async def latency_ours(n: int, warm: int) -> dict[str, Any]:
    b = await started(cfg())
    try:
        slot = await b.acquire("latency")
        req = [(slot, "bash", {"command": "echo hi"})]
        for _ in range(warm):
            [r] = await b.execute_batch(req)
        xs, agent = [], []
        for _ in range(n):
            t0 = perf()
            [r] = await b.execute_batch(req)
            xs.append(perf() - t0)
            agent.append(r.metadata.get("duration_s") or 0.0)
        assert r.success and r.output == "hi\n", r
        limits = b.get_status()["pools"][PROFILE]["limits"]
        await b.release(slot, reset_workspace=True)
    finally:
        await b.stop()
    out = summary_ms(xs)
    out["agent_side_median_ms"] = quantile(agent, 0.5) * 1e3
    out["limits"] = limits
    return out


# -- b. throughput ------------------------------------------------------------------------
async def throughput_ours(slots: int, cmds: int, sandboxes: int) -> dict[str, Any]:
    b = await started(cfg(slots_per_sandbox=slots // sandboxes, min_sandboxes=sandboxes,
                        max_sandboxes=sandboxes))
    try:
        ss = [await b.acquire(f"tp-{i}") for i in range(slots)]
        for _ in range(3):  # warm-up: spawns every slot's shell
            rs = await b.execute_batch([(s, "bash", {"command": "true"}) for s in ss])
            assert all(r.success for r in rs), [r for r in rs if not r.success][:1]
        bad = 0
        c0 = cpu_by_kind()
        t0 = perf()
        for i in range(cmds):
            rs = await b.execute_batch([(s, "bash", {"command": f"echo {i}"}) for s in ss])
            bad += sum(r.output != f"{i}\n" for r in rs)
        rounds = perf() - t0
        c1 = cpu_by_kind()
        reqs = [(s, "bash", {"command": f"echo {i}"}) for i in range(cmds) for s in ss]
        t0 = perf()
        rs = await b.execute_batch(reqs)
        big = perf() - t0
        bad += sum(r.output != f"{i}\n" for i in range(cmds) for r in rs[i * slots:(i + 1) * slots])
        for s in ss:
            await b.release(s)
    finally:
        await b.stop()
    total = slots * cmds
    return {"slots": slots, "sandboxes": sandboxes, "calls": total, "wrong_outputs": bad,
            "rounds_s": rounds, "rounds_calls_per_s": total / rounds,
            "round_ms": rounds / cmds * 1e3,
            "big_batch_s": big, "big_batch_calls_per_s": total / big,
            "cpu_us_per_call": {k: (c1[k] - c0.get(k, 0.0)) / total * 1e6 for k in c1}}


# -- c. acquire / release -------------------------------------------------------------------
# 200 MB in 5,000 files of 40 KiB, in the slot's /usr (its writable layer); prints MB.
BIG_STATE = ("mkdir -p /usr/share/hmt-bulk && cd /usr/share/hmt-bulk && for d in $(seq 50); do "
             "mkdir $d; for f in $(seq 100); do head -c 40960 /dev/zero > $d/$f; done; done; "
             "du -sm . | cut -f1")


#: Seconds between the paced acquire + command + release cycles of section c.
PACE_S = 0.05


async def acquire_release(n: int, warm: int) -> dict[str, Any]:
    b = await started(cfg())
    try:
        async def bare() -> float:
            t0 = perf()
            s = await b.acquire("ar")
            await b.release(s, reset_workspace=True)
            return perf() - t0

        async def with_cmd() -> tuple[float, float, float, float]:
            t0 = perf()
            s = await b.acquire("ar1")
            t1 = perf()
            [r] = await b.execute_batch([(s, "bash", {"command": "true"})])
            t2 = perf()
            await b.release(s, reset_workspace=True)
            t3 = perf()
            assert r.success, r
            return t3 - t0, t1 - t0, t2 - t1, t3 - t2

        async def after_big(rounds: int) -> list[float]:
            """release(reset) + acquire of a slot whose last tenant wrote 200 MB in 5,000
            files into its root (its writable layer is dropped, not deleted in line)."""
            out = []
            for i in range(rounds):
                s = await b.acquire(f"big{i}")
                [r] = await b.execute_batch([(s, "bash", {"command": BIG_STATE, "timeout": 300})])
                assert r.success and int(r.output) >= 190, r
                t0 = perf()
                await b.release(s, reset_workspace=True)
                s = await b.acquire(f"after{i}")
                out.append(perf() - t0)
                await b.release(s, reset_workspace=True)
            return out

        for _ in range(warm):
            await bare()
            await with_cmd()
        xs = [await bare() for _ in range(n)]
        c0, m0 = cpu_by_kind(), busy_cpu_s()
        ys = [await with_cmd() for _ in range(n)]
        c1, m1 = cpu_by_kind(), busy_cpu_s()
        paced = []  # one every PACE_S: the machine keeps up with the background work
        for _ in range(n // 2):
            paced.append(await with_cmd())
            await asyncio.sleep(PACE_S)
        zs = await after_big(3 if n < 100 else 8)
        filesystem = b.get_status()["pools"][PROFILE]["filesystem"]
        sandbox = next(iter(b._pools[PROFILE]._sandboxes.values()))
        status = await sandbox.request({"op": "status"}, 10.0)
        shell_start = (status.get("result") or {}).get("shell_start")
    finally:
        await b.stop()
    return {"filesystem": filesystem, "shell_start": shell_start, "after_200mb": summary_ms(zs),
            "acquire_release": summary_ms(xs),
            "acquire_cmd_release": summary_ms([y[0] for y in ys]),
            "acquire_cmd_release_paced": summary_ms([y[0] for y in paced]), "pace_s": PACE_S,
            "paced_parts_ms": [summary_ms([y[i] for y in paced])["median"] for i in (1, 2, 3)],
            "cpu_ms_per_cycle": {k: (c1[k] - c0.get(k, 0.0)) / n * 1e3 for k in c1},
            "machine_busy_ms_per_cycle": (m1 - m0) / n * 1e3,
            "part_acquire": summary_ms([y[1] for y in ys]),
            "part_first_cmd": summary_ms([y[2] for y in ys]),
            "part_release_reset": summary_ms([y[3] for y in ys])}


# -- d. cold start ---------------------------------------------------------------------------
async def cold_start(repeats: int, fresh_slots: int) -> dict[str, Any]:
    starts, firsts, seconds = [], [], []
    for _ in range(repeats):
        b = ToolBackend(cfg())
        try:
            t0 = perf()
            await b.start()
            starts.append(perf() - t0)
            s = await b.acquire("cold")
            t0 = perf()
            [r] = await b.execute_batch([(s, "bash", {"command": "true"})])
            firsts.append(perf() - t0)
            t0 = perf()
            [r] = await b.execute_batch([(s, "bash", {"command": "true"})])
            seconds.append(perf() - t0)
            assert r.success, r
        finally:
            track(b)
            await b.stop()
    # Pool growth: a running backend starts a second sandbox for the 101st acquire (on a
    # new backend each time, so every sample is a first growth); the first command in
    # fresh slots is measured on the first of them.
    growth, fresh = [], []
    for rep in range(max(1, repeats // 2)):
        b = await started(cfg(max_sandboxes=2, scale_down_idle=False))
        try:
            held = [await b.acquire(f"g{i}") for i in range(100)]
            t0 = perf()
            extra = await b.acquire("grow")
            growth.append(perf() - t0)
            assert extra.sandbox_id != held[0].sandbox_id
            for s in held[:fresh_slots] if rep == 0 else []:
                t0 = perf()
                [r] = await b.execute_batch([(s, "bash", {"command": "true"})])
                fresh.append(perf() - t0)
                assert r.success, r
        finally:
            await b.stop()
    return {"backend_start": summary_ms(starts), "first_cmd_after_start": summary_ms(firsts),
            "second_cmd": summary_ms(seconds), "growth_sandbox_start": summary_ms(growth),
            "first_cmd_fresh_slot": summary_ms(fresh)}


def start_floors(n: int) -> dict[str, Any]:
    """What a sandbox start is made of, measured bare: a Python interpreter start (the
    agent) and a bubblewrap user-namespace sandbox running ``true`` (one slot shell)."""
    from hermes_modal_tool.drivers.local import find_bwrap
    bwrap = find_bwrap()
    runs = {
        "python -I -S -c pass": [sys.executable, "-I", "-S", "-c", "pass"],
        "python -I -S -c 'import asyncio, json, subprocess'":
            [sys.executable, "-I", "-S", "-c", "import asyncio, json, subprocess"],
        # The agent blocks ssl (it speaks no TLS; loading OpenSSL costs ~30 ms).
        "the same with ssl blocked, as the agent does":
            [sys.executable, "-I", "-S", "-c",
             "import sys; sys.modules['ssl'] = None; import asyncio, json, subprocess"],
        "bwrap --unshare-user --unshare-pid --ro-bind / / true":
            [bwrap, "--unshare-user", "--unshare-pid", "--ro-bind", "/", "/", "--proc", "/proc",
             "--dev", "/dev", "true"],
    }
    out = {}
    for label, argv in runs.items():
        xs = []
        for _ in range(n):
            t0 = perf()
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
            xs.append(perf() - t0)
        out[label] = summary_ms(xs)
    return out


# -- f. shells per second (benchmarks/_fresh.py) ---------------------------------------------
async def _fresh_backend(per_sandbox: int, sandboxes: int) -> ToolBackend:
    return await started(cfg(slots_per_sandbox=per_sandbox, min_sandboxes=sandboxes,
                             max_sandboxes=sandboxes, scale_down_idle=False))


# -- e. memory ------------------------------------------------------------------------------
def _settle() -> dict[str, int]:
    time.sleep(1.0)
    return meminfo()


async def memory(slots: int, per_sandbox: int) -> dict[str, Any]:
    per_sandbox = min(per_sandbox, slots)
    sandboxes = -(-slots // per_sandbox)
    before = await asyncio.to_thread(_settle)
    b = ToolBackend(cfg(slots_per_sandbox=per_sandbox, min_sandboxes=sandboxes, max_sandboxes=sandboxes,
                        execution_timeout_s=300, scale_down_idle=False))
    try:
        t0 = perf()
        await b.start()
        start_s = perf() - t0
        ss = [await b.acquire(f"m{i}") for i in range(slots)]
        mem_agents_only = await asyncio.to_thread(process_memory)
        t0 = perf()
        rs = await b.execute_batch([(s, "bash", {"command": "true"}) for s in ss])
        spawn_s = perf() - t0
        failed = [r for r in rs if not r.success]
        after = await asyncio.to_thread(_settle)
        procs = await asyncio.to_thread(process_memory)
        t0 = perf()
        rs = await b.execute_batch([(s, "bash", {"command": "echo $HOSTNAME"}) for s in ss])
        echo_s = perf() - t0
        live = sum(r.success and r.output == f"slot-{s.index}\n" for s, r in zip(ss, rs, strict=True))
        wrong = [(s.slot_id, r.output, r.error) for s, r in zip(ss, rs, strict=True)
                 if not (r.success and r.output == f"slot-{s.index}\n")][:3]
        status = b.get_status()
        for s in ss:
            await b.release(s)
    finally:
        track(b)
        await b.stop()
    stopped = await asyncio.to_thread(_settle)
    pss = sum(v["pss_kib"] for v in procs.values())
    delta = before["MemAvailable"] - after["MemAvailable"]
    return {
        "slots": slots, "sandboxes": sandboxes, "slots_per_sandbox": per_sandbox,
        "start_s": start_s, "spawn_all_s": spawn_s, "spawn_failures": len(failed),
        "spawn_failure_sample": [f.error for f in failed[:3]],
        "echo_all_s": echo_s, "live_slots": live, "wrong_sample": wrong,
        "memavailable_delta_mib": delta / 1024, "memavailable_mib_per_slot": delta / 1024 / slots,
        "pss_total_mib": pss / 1024, "pss_mib_per_slot": pss / 1024 / slots,
        "slab_delta_mib": (after["Slab"] - before["Slab"]) / 1024,
        "pagetables_delta_mib": (after.get("PageTables", 0) - before.get("PageTables", 0)) / 1024,
        "shmem_delta_mib": (after["Shmem"] - before["Shmem"]) / 1024,
        "memavailable_not_returned_mib": (before["MemAvailable"] - stopped["MemAvailable"]) / 1024,
        "after_stop_slab_pagetables_delta_mib": (stopped["Slab"] + stopped.get("PageTables", 0)
                                                 - before["Slab"] - before.get("PageTables", 0)) / 1024,
        "by_kind": procs, "agents_before_shells": mem_agents_only,
        "total_slots_reported": status["total_slots"],
    }


# -- report -----------------------------------------------------------------------------------
# -- main ---------------------------------------------------------------------------------------
#: Per measured step: wall seconds, CPU seconds used by this process tree, CPU seconds used
#: by everything else on the machine (other users of a shared machine skew the numbers).
CPU_LOG: list[dict[str, Any]] = []


def own_cpu_s() -> float:
    """CPU seconds of this process and of its reaped descendants."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def timed(label: str, fn: Callable[[], Any], optional: bool = False) -> Any:
    """Run one step, logging its wall time and the CPU used by us and by others.

    ``optional`` steps (the SWE-ReX comparisons) report a failure instead of raising.
    """
    log(label)
    x0 = others_cpu()
    t0, b0, o0 = perf(), busy_cpu_s(), own_cpu_s()
    try:
        out = fn()
    except Exception as exc:
        if not optional:
            raise
        log(f"{label} failed: {type(exc).__name__}: {exc}"[:300])
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    wall, busy, own = perf() - t0, busy_cpu_s() - b0, own_cpu_s() - o0
    orphans = reap_orphans()
    ORPHANS["zombie"] += len(orphans["zombie"])
    x1 = others_cpu()
    # Lower bound: processes outside our tree alive at both ends. Upper bound: all busy
    # time minus ours (also counts short-lived processes of others, and our processes'
    # CPU that no reaped parent passed on to us).
    deltas = sorted(((v - x0[k], k[0]) for k, v in x1.items() if k in x0), reverse=True)
    other_low = sum(d for d, _ in deltas)
    other = max(0.0, busy - own)
    top = []
    for d, pid in deltas[:2]:
        if d > 0.05 * wall:
            try:
                with open(f"/proc/{pid}/cmdline") as fh:
                    top.append(f"{d / wall:.2f} cores: {fh.read().replace(chr(0), ' ')[:80]}")
            except OSError:
                pass
    CPU_LOG.append({"step": label, "wall_s": wall, "own_cpu_s": own, "other_cpu_s": other,
                    "other_cpu_low_s": other_low, "top_others": top})
    for t in top:
        log(f"   busy elsewhere: {t}")
    log(f"{label}: {wall:.1f} s (CPU: ours {own:.1f} s; other processes {other_low:.1f}..{other:.1f} s = "
        f"{other_low / wall:.2f}..{other / wall:.2f} cores busy elsewhere)")
    return out


def wait_idle(max_wait: float, threshold: float = 0.15) -> float:
    """Wait (up to ``max_wait`` s) until the machine is quiet: less than ``threshold``
    cores busy for 3 s in a row. Returns the busy cores seen last."""
    deadline = time.monotonic() + max_wait
    quiet = 0
    load = math.nan
    while time.monotonic() < deadline:
        b0 = busy_cpu_s()
        time.sleep(1.0)
        load = busy_cpu_s() - b0
        quiet = quiet + 1 if load < threshold else 0
        if quiet >= 3:
            break
    return load


def run(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    sections = set(args.sections.split(","))
    res: dict[str, Any] = {"machine": machine(), "quick": q, "subreaper": become_subreaper()}
    if args.wait_idle:
        log(f"waiting up to {args.wait_idle:g} s for the machine to be idle")
        t0 = perf()
        res["busy_cores_before"] = wait_idle(args.wait_idle)
        log(f"waited {perf() - t0:.0f} s; {res['busy_cores_before']:.2f} cores busy in the last second")
    t_start = perf()
    swerex = not args.no_swerex
    if swerex:
        try:
            _swerex_imports()
        except ImportError as exc:
            log(f"swe-rex not importable ({exc}); skipping it")
            swerex = False
    if "a" in sections:
        lat: dict[str, Any] = {}
        lat["ours"] = timed("a. ours", lambda: asyncio.run(latency_ours(500 if q else 5000, 200 if q else 500)))
        if swerex:
            lat["swerex"] = timed("a. swe-rex", lambda: asyncio.run(latency_swerex(10 if q else 60, 3 if q else 5)),
                                  optional=True)
        lat["subprocess"] = timed("a. subprocess", lambda: latency_subprocess(100 if q else 500, 10 if q else 30))
        lat["raw_bash"] = summary_ms(timed("a. floor: raw bash", lambda: raw_bash_echo(
            500 if q else 5000, 100)))
        res["latency"] = lat
    if "b" in sections:
        tp: dict[str, Any] = {"ours": []}
        n_slots, n_cmds = (100, 20) if q else (100, 100)
        for sbx in (1, 2):
            tp["ours"].append(timed(f"b. ours {sbx} sandbox(es)",
                                    lambda sbx=sbx: asyncio.run(throughput_ours(n_slots, n_cmds, sbx))))
        tp["raw_bash"] = timed("b. floor: raw bash", lambda: raw_bash_throughput(n_slots, n_cmds))
        tp["raw_bash_cgroups"] = timed("b. floor: raw bash in cgroups",
                                       lambda: raw_bash_throughput(n_slots, n_cmds, cgroups=True))
        n_sub = 500 if q else 3000
        tp["subprocess_threads"] = timed("b. subprocess threads", lambda: throughput_subprocess_threads(n_sub, 16))
        tp["subprocess_asyncio"] = timed("b. subprocess asyncio",
                                         lambda: asyncio.run(throughput_subprocess_asyncio(n_sub, 64)))
        if swerex:
            tp["swerex_threads"] = timed("b. swe-rex threads", lambda: throughput_swerex_threads(
                8 if q else 32, 3 if q else 10), optional=True)
            if not q:
                tp["swerex_gather"] = timed("b. swe-rex gather",
                                            lambda: asyncio.run(throughput_swerex_gather(4, 4)), optional=True)
        res["throughput"] = tp
    if "c" in sections:
        res["acquire_release"] = timed("c. acquire/release", lambda: asyncio.run(
            acquire_release(50 if q else 200, 10 if q else 20)))
    if "d" in sections:
        res["cold"] = timed("d. cold start", lambda: asyncio.run(cold_start(3 if q else 7, 10 if q else 30)))
        res["cold"]["floors"] = timed("d. floors", lambda: start_floors(3 if q else 10))
    if "e" in sections:
        slots = args.slots if args.slots is not None else (100 if q else 1000)
        res["memory"] = timed(f"e. memory {slots} slots", lambda: asyncio.run(memory(slots, args.per_sandbox)))
    if "f" in sections:
        from hermes_modal_tool.drivers.local import find_bwrap
        n_fresh = 200 if q else 1000
        res["fresh"] = timed(f"f. fresh shells {n_fresh}", lambda: asyncio.run(fresh_shells(_fresh_backend, n_fresh, 100)))
        res["fresh"]["floor"] = timed("f. floor: bwrap true", lambda: bwrap_true_rate(
            find_bwrap(), 100 if q else 400, os.cpu_count() or 2))
        res["fresh"]["live_floor"] = timed("f. floor: live shells", lambda: live_shells_rate(
            find_bwrap(), n_fresh, os.cpu_count() or 2))
    if "g" in sections:
        res["streaming"] = timed("g. streaming", lambda: asyncio.run(
            streaming.measure(20 if q else 100, 100 if q else 300)))
    res["cleanup"] = wait_clean()
    res["wall_s"] = perf() - t_start
    res["cpu_log"] = CPU_LOG
    res["facts"] = FACTS
    return res


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small, fast run (~15 s)")
    ap.add_argument("--slots", type=int, default=None, help="slots for the memory test (default 1000; 100 with --quick)")
    ap.add_argument("--per-sandbox", type=int, default=100, help="slots per sandbox for the memory test")
    ap.add_argument("--sections", default="a,b,c,d,e,f,g", help="which sections to run (default a,b,c,d,e,f,g)")
    ap.add_argument("--no-swerex", action="store_true", help="skip the SWE-ReX comparison")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="S",
                    help="first wait up to S seconds for other processes to go quiet (shared machines)")
    args = ap.parse_args(argv)
    threading.current_thread().name = "bench"
    res = run(args)
    print(render(res, args.quick), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2, default=str)
    return 0 if res["cleanup"]["clean"] else 1


if __name__ == "__main__":
    sys.exit(main())
