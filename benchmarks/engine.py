"""Engine benchmark: our slot engine vs SWE-ReX's LocalRuntime vs ``subprocess.run``.

Measured in one run, side by side:

a. warm ``echo`` round trip on one slot (median / p90 / p99 ms);
b. throughput: 100 slots x 100 trivial commands (rounds of ``execute_batch`` and one
   big batch), against parallel ``subprocess.run`` and parallel SWE-ReX sessions;
c. ``acquire`` + ``release(reset_workspace=True)`` (with and without one command);
d. cold start: a pool with ``min_sandboxes=1`` to ready, an extra sandbox started by
   pool growth, and the first command in a fresh slot (the bwrap spawn);
e. idle memory per live slot (``--slots``, default 1000): MemAvailable delta and the
   summed PSS of every engine process, divided by the number of slots.

Usage::

    .venv/bin/python benchmarks/engine.py            # full run (~1-2 minutes)
    .venv/bin/python benchmarks/engine.py --quick    # small, fast run
    .venv/bin/python benchmarks/engine.py --slots 500 --json /tmp/bench.json
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hermes_modal_tool import SandboxConfig, ToolBackend

perf = time.perf_counter

TARGETS = {
    "latency_median_ms": 0.5,
    "speedup_vs_swerex": 100.0,
    "calls_per_s": 10_000.0,
    "acquire_release_p50_ms": 5.0,
    "sandbox_start_ms": 100.0,
    "mib_per_slot": 5.0,
}


# -- small helpers -------------------------------------------------------------------
def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of ``xs`` (0 <= q <= 1)."""
    s = sorted(xs)
    if not s:
        return math.nan
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary_ms(xs: Sequence[float]) -> dict[str, float]:
    """Seconds in, a dict of milliseconds out."""
    return {"n": len(xs), "median": quantile(xs, 0.5) * 1e3, "p90": quantile(xs, 0.9) * 1e3,
            "p99": quantile(xs, 0.99) * 1e3, "min": min(xs) * 1e3, "max": max(xs) * 1e3,
            "mean": sum(xs) / len(xs) * 1e3}


def fmt_ms(v: float) -> str:
    if v != v:
        return "n/a"
    if v < 1:
        return f"{v * 1000:.0f} µs"
    if v < 100:
        return f"{v:.2f} ms"
    return f"{v:.0f} ms"


def fmt_lat(s: dict[str, float]) -> str:
    return f"{fmt_ms(s['median'])} / {fmt_ms(s['p90'])} / {fmt_ms(s['p99'])}"


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in KiB."""
    out = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0])
    return out


def descendants(root: int) -> list[int]:
    """Pids of every live descendant of ``root`` (through /proc/*/stat ppids)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


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
        if kind == "gone":
            continue
        pss, rss = pss_kib(pid)
        d = by.setdefault(kind, {"count": 0, "pss_kib": 0, "rss_kib": 0})
        d["count"] += 1
        d["pss_kib"] += pss
        d["rss_kib"] += rss
    return by


def leftovers() -> dict[str, Any]:
    """Processes matching ``pgrep -f bwrap`` (live vs zombie) and state left behind."""
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
    shells = [p for p in descendants(os.getpid()) if proc_kind(p) in ("bash", "agent", "bwrap", "bwrap-init")]
    dirs = []
    for base in ("/dev/shm", "/tmp"):
        try:
            dirs += [f"{base}/{e}" for e in os.listdir(base) if e.startswith("hermes-modal-tool-")]
        except OSError:
            pass
    cg = [p for p in ("/sys/fs/cgroup/memory/hermes-modal-tool", "/sys/fs/cgroup/pids/hermes-modal-tool",
                      "/sys/fs/cgroup/cpu/hermes-modal-tool") if os.path.isdir(p) and os.listdir(p)
          and any(os.path.isdir(os.path.join(p, e)) for e in os.listdir(p))]
    return {"bwrap_live": live, "bwrap_zombie": zombie, "descendants": shells,
            "state_dirs": dirs, "cgroup_dirs": cg}


def wait_clean(timeout: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        left = leftovers()
        if (not left["bwrap_live"] and not left["descendants"]) or time.monotonic() > deadline:
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
    return {"nproc": len(os.sched_getaffinity(0)), "cpu": model,
            "mem_total_gib": round(mem["MemTotal"] / 1024 / 1024, 1),
            "kernel": platform.release(), "python": sys.version.split()[0],
            "bwrap": bwrap, "bwrap_version": bver, "swe_rex": swerex, "euid": os.geteuid()}


def cfg(**kw: Any) -> SandboxConfig:
    base = {"slots_per_sandbox": 100, "min_sandboxes": 1, "max_sandboxes": 1, "execution_timeout_s": 60}
    base.update(kw)
    return SandboxConfig(**base)


def log(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


# -- a. latency --------------------------------------------------------------------------
async def latency_ours(n: int, warm: int) -> dict[str, Any]:
    b = ToolBackend(cfg())
    await b.start()
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
        limits = b.get_status()["pools"]["default"]["limits"]
        await b.release(slot, reset_workspace=True)
    finally:
        await b.stop()
    out = summary_ms(xs)
    out["agent_side_median_ms"] = quantile(agent, 0.5) * 1e3
    out["limits"] = limits
    return out


def _swerex_imports():
    from swerex.runtime.abstract import (
        BashAction,
        CloseBashSessionRequest,
        CreateBashSessionRequest,
    )
    from swerex.runtime.local import LocalRuntime
    return LocalRuntime, CreateBashSessionRequest, BashAction, CloseBashSessionRequest


async def latency_swerex(n: int, warm: int) -> dict[str, Any]:
    LocalRuntime, Create, BashAction, Close = _swerex_imports()
    rt = LocalRuntime()
    t0 = perf()
    await rt.create_session(Create(session="bench"))
    create = perf() - t0
    try:
        action = BashAction(command="echo hi", session="bench")
        for _ in range(warm):
            obs = await rt.run_in_session(action)
        xs = []
        for _ in range(n):
            t0 = perf()
            obs = await rt.run_in_session(action)
            xs.append(perf() - t0)
        assert obs.exit_code == 0 and "hi" in obs.output, obs
    finally:
        await rt.close_session(Close(session="bench"))
        await rt.close()
    out = summary_ms(xs)
    out["session_create_ms"] = create * 1e3
    return out


def _sub_once() -> None:
    r = subprocess.run(["bash", "-c", "echo hi"], capture_output=True)
    if r.stdout != b"hi\n":
        raise RuntimeError(r)


def latency_subprocess(n: int, warm: int) -> dict[str, Any]:
    for _ in range(warm):
        _sub_once()
    xs = []
    for _ in range(n):
        t0 = perf()
        _sub_once()
        xs.append(perf() - t0)
    return summary_ms(xs)


# -- b. throughput ------------------------------------------------------------------------
async def throughput_ours(slots: int, cmds: int, sandboxes: int) -> dict[str, Any]:
    b = ToolBackend(cfg(slots_per_sandbox=slots // sandboxes, min_sandboxes=sandboxes,
                        max_sandboxes=sandboxes))
    await b.start()
    try:
        ss = [await b.acquire(f"tp-{i}") for i in range(slots)]
        for _ in range(3):  # warm-up: spawns every slot's shell
            rs = await b.execute_batch([(s, "bash", {"command": "true"}) for s in ss])
            assert all(r.success for r in rs), [r for r in rs if not r.success][:1]
        bad = 0
        t0 = perf()
        for i in range(cmds):
            rs = await b.execute_batch([(s, "bash", {"command": f"echo {i}"}) for s in ss])
            bad += sum(r.output != f"{i}\n" for r in rs)
        rounds = perf() - t0
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
            "big_batch_s": big, "big_batch_calls_per_s": total / big}


def throughput_subprocess_threads(calls: int, workers: int) -> dict[str, Any]:
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(lambda _: _sub_once(), range(workers * 2)))
        t0 = perf()
        list(ex.map(lambda _: _sub_once(), range(calls)))
        dt = perf() - t0
    return {"calls": calls, "workers": workers, "seconds": dt, "calls_per_s": calls / dt}


async def throughput_subprocess_asyncio(calls: int, concurrency: int) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            p = await asyncio.create_subprocess_exec(
                "bash", "-c", "echo hi", stdout=asyncio.subprocess.PIPE)
            out, _ = await p.communicate()
            if out != b"hi\n":
                raise RuntimeError(out)

    await asyncio.gather(*(one() for _ in range(concurrency)))
    t0 = perf()
    await asyncio.gather(*(one() for _ in range(calls)))
    dt = perf() - t0
    return {"calls": calls, "concurrency": concurrency, "seconds": dt, "calls_per_s": calls / dt}


def throughput_swerex_threads(sessions: int, cmds: int) -> dict[str, Any]:
    """One LocalRuntime + event loop per thread: SWE-ReX's session calls block, so
    threads are the only way to run its sessions in parallel."""
    LocalRuntime, Create, BashAction, Close = _swerex_imports()

    def create(i: int) -> tuple[asyncio.AbstractEventLoop, Any]:
        loop = asyncio.new_event_loop()
        rt = LocalRuntime()
        loop.run_until_complete(rt.create_session(Create(session=f"s{i}")))
        loop.run_until_complete(rt.run_in_session(BashAction(command="true", session=f"s{i}")))
        return loop, rt

    def run(i: int, lr: tuple[asyncio.AbstractEventLoop, Any]) -> int:
        loop, rt = lr
        ok = 0
        for k in range(cmds):
            obs = loop.run_until_complete(rt.run_in_session(BashAction(command=f"echo {k}", session=f"s{i}")))
            ok += obs.output.strip() == str(k)
        return ok

    def close(lr: tuple[asyncio.AbstractEventLoop, Any]) -> None:
        loop, rt = lr
        try:
            loop.run_until_complete(rt.close())
        finally:
            loop.close()

    with ThreadPoolExecutor(sessions) as ex:
        t0 = perf()
        lrs = list(ex.map(create, range(sessions)))
        created = perf() - t0
        try:
            t0 = perf()
            oks = list(ex.map(run, range(sessions), lrs))
            dt = perf() - t0
        finally:
            list(ex.map(close, lrs))
    total = sessions * cmds
    return {"sessions": sessions, "calls": total, "ok": sum(oks), "seconds": dt,
            "calls_per_s": total / dt, "create_all_s": created}


async def throughput_swerex_gather(sessions: int, cmds: int) -> dict[str, Any]:
    """asyncio.gather over sessions in one loop (how an async caller would try it)."""
    LocalRuntime, Create, BashAction, Close = _swerex_imports()
    rt = LocalRuntime()
    for i in range(sessions):
        await rt.create_session(Create(session=f"g{i}"))
    try:
        t0 = perf()
        for k in range(cmds):
            await asyncio.gather(*(rt.run_in_session(BashAction(command=f"echo {k}", session=f"g{i}"))
                                   for i in range(sessions)))
        dt = perf() - t0
    finally:
        await rt.close()
    total = sessions * cmds
    return {"sessions": sessions, "calls": total, "seconds": dt, "calls_per_s": total / dt}


# -- c. acquire / release -------------------------------------------------------------------
async def acquire_release(n: int, warm: int) -> dict[str, Any]:
    b = ToolBackend(cfg())
    await b.start()
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

        for _ in range(warm):
            await bare()
            await with_cmd()
        xs = [await bare() for _ in range(n)]
        ys = [await with_cmd() for _ in range(n)]
    finally:
        await b.stop()
    return {"acquire_release": summary_ms(xs),
            "acquire_cmd_release": summary_ms([y[0] for y in ys]),
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
            await b.stop()
    # Pool growth: a running backend starts a second sandbox for the 101st acquire.
    growth, fresh = [], []
    b = ToolBackend(cfg(max_sandboxes=2, scale_down_idle=False))
    await b.start()
    try:
        held = [await b.acquire(f"g{i}") for i in range(100)]
        t0 = perf()
        extra = await b.acquire("grow")
        growth.append(perf() - t0)
        assert extra.sandbox_id != held[0].sandbox_id
        for s in held[:fresh_slots]:
            t0 = perf()
            [r] = await b.execute_batch([(s, "bash", {"command": "true"})])
            fresh.append(perf() - t0)
            assert r.success, r
    finally:
        await b.stop()
    return {"backend_start": summary_ms(starts), "first_cmd_after_start": summary_ms(firsts),
            "second_cmd": summary_ms(seconds), "growth_sandbox_start": summary_ms(growth),
            "first_cmd_fresh_slot": summary_ms(fresh)}


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
        "by_kind": procs, "agents_before_shells": mem_agents_only,
        "total_slots_reported": status["total_slots"],
    }


# -- report -----------------------------------------------------------------------------------
def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def render(res: dict[str, Any], quick: bool) -> str:
    lines: list[str] = []
    add = lines.append
    m = res["machine"]
    add("=" * 100)
    add(f"hermes_modal_tool engine benchmark{' (--quick)' if quick else ''}")
    add(f"machine: nproc={m['nproc']} ({m['cpu']}), mem={m['mem_total_gib']} GiB, kernel {m['kernel']}, "
        f"python {m['python']}, euid={m['euid']}")
    add(f"bwrap: {m['bwrap']} ({m['bwrap_version']}); swe-rex {m['swe_rex']}; "
        f"limits mode: {res.get('latency', {}).get('ours', {}).get('limits')}")
    add("=" * 100)
    row = "{:<46} {:>24} {:>14} {:>10}".format
    if "latency" in res:
        lat = res["latency"]
        o, s, p = lat["ours"], lat.get("swerex"), lat["subprocess"]
        add("a. warm `echo hi` round trip, one slot — median / p90 / p99")
        add(row("", "value", "target", "status"))
        add(row(f"   ours (execute_batch, n={o['n']})", fmt_lat(o), "<= 0.5 ms",
                verdict(o["median"] <= TARGETS["latency_median_ms"])))
        add(f"      (agent-side part of the median: {fmt_ms(o['agent_side_median_ms'])}; "
            f"min {fmt_ms(o['min'])})")
        if s:
            add(row(f"   SWE-ReX LocalRuntime session (n={s['n']})", fmt_lat(s), "", ""))
            add(f"      (session create: {fmt_ms(s['session_create_ms'])})")
        add(row(f"   subprocess.run(bash -c) (n={p['n']})", fmt_lat(p), "", ""))
        if s:
            sp = s["median"] / o["median"]
            add(row("   speedup ours vs SWE-ReX (median)", f"{sp:,.0f}x", ">= 100x",
                    verdict(sp >= TARGETS["speedup_vs_swerex"])))
        add(row("   speedup ours vs subprocess.run (median)", f"{p['median'] / o['median']:,.1f}x", "", ""))
        add("")
    if "throughput" in res:
        tp = res["throughput"]
        add("b. throughput — trivial commands (calls/s)")
        add(row("", "calls/s", "target", "status"))
        for t in tp["ours"]:
            tag = f"{t['sandboxes']} sandbox{'es' if t['sandboxes'] > 1 else ''} x {t['slots'] // t['sandboxes']} slots"
            add(row(f"   ours, {t['slots']}x{t['calls'] // t['slots']} as rounds ({tag})",
                    f"{t['rounds_calls_per_s']:,.0f}", ">= 10,000",
                    verdict(t["rounds_calls_per_s"] >= TARGETS["calls_per_s"])))
            add(f"      (one round of {t['slots']} calls: {fmt_ms(t['round_ms'])}; wrong outputs: {t['wrong_outputs']})")
            add(row(f"   ours, same as one big batch ({tag})", f"{t['big_batch_calls_per_s']:,.0f}",
                    ">= 10,000", verdict(t["big_batch_calls_per_s"] >= TARGETS["calls_per_s"])))
        st = tp["subprocess_threads"]
        add(row(f"   subprocess.run, thread pool of {st['workers']} ({st['calls']})", f"{st['calls_per_s']:,.0f}", "", ""))
        sa = tp["subprocess_asyncio"]
        add(row(f"   asyncio subprocess, {sa['concurrency']} at a time ({sa['calls']})",
                f"{sa['calls_per_s']:,.0f}", "", ""))
        if tp.get("swerex_threads"):
            sw = tp["swerex_threads"]
            add(row(f"   SWE-ReX, {sw['sessions']} sessions in threads ({sw['calls']})",
                    f"{sw['calls_per_s']:,.0f}", "", ""))
            add(f"      ({sw['ok']}/{sw['calls']} outputs correct; creating {sw['sessions']} sessions took "
                f"{sw['create_all_s']:.2f} s)")
        if tp.get("swerex_gather"):
            sg = tp["swerex_gather"]
            add(row(f"   SWE-ReX, asyncio.gather over {sg['sessions']} sessions", f"{sg['calls_per_s']:,.1f}", "", ""))
            add("      (one event loop: BashSession.run blocks in pexpect, so gather runs serially)")
        best = max(max(t["rounds_calls_per_s"], t["big_batch_calls_per_s"]) for t in tp["ours"])
        if tp.get("swerex_threads"):
            add(row("   speedup ours (best) vs SWE-ReX threads", f"{best / tp['swerex_threads']['calls_per_s']:,.0f}x", "", ""))
        add(row("   speedup ours (best) vs subprocess threads", f"{best / st['calls_per_s']:,.1f}x", "", ""))
        add("")
    if "acquire_release" in res:
        ar = res["acquire_release"]
        add("c. acquire + release(reset_workspace=True) — p50 / p99")
        add(row("", "p50 / p99", "target", "status"))
        a = ar["acquire_release"]
        add(row(f"   acquire + release (n={a['n']})", f"{fmt_ms(a['median'])} / {fmt_ms(a['p99'])}",
                "p50 <= 5 ms", verdict(a["median"] <= TARGETS["acquire_release_p50_ms"])))
        c = ar["acquire_cmd_release"]
        add(row("   acquire + 1 command + release", f"{fmt_ms(c['median'])} / {fmt_ms(c['p99'])}",
                "(p50 <= 5 ms)", verdict(c["median"] <= TARGETS["acquire_release_p50_ms"])))
        add(f"      parts p50: acquire {fmt_ms(ar['part_acquire']['median'])}, first command "
            f"{fmt_ms(ar['part_first_cmd']['median'])} (spawns the shell), release+reset "
            f"{fmt_ms(ar['part_release_reset']['median'])}")
        add("")
    if "cold" in res:
        cs = res["cold"]
        add("d. cold start — median (min..max)")
        add(row("", "median", "target", "status"))
        bs = cs["backend_start"]
        add(row(f"   new backend: start() to ready (n={bs['n']})",
                f"{fmt_ms(bs['median'])} ({fmt_ms(bs['min'])}..{fmt_ms(bs['max'])})"[:24], "<= 100 ms",
                verdict(bs["median"] <= TARGETS["sandbox_start_ms"])))
        g = cs["growth_sandbox_start"]
        add(row("   extra sandbox by pool growth (acquire)", fmt_ms(g["median"]), "<= 100 ms",
                verdict(g["median"] <= TARGETS["sandbox_start_ms"])))
        f = cs["first_cmd_fresh_slot"]
        add(row(f"   first command in a fresh slot (n={f['n']})", fmt_lat(f), "", ""))
        add(f"      (first command right after start(): {fmt_ms(cs['first_cmd_after_start']['median'])}; "
            f"the second command: {fmt_ms(cs['second_cmd']['median'])})")
        add("")
    if "memory" in res:
        mm = res["memory"]
        add(f"e. idle memory per live slot — {mm['slots']} slots in {mm['sandboxes']} sandboxes "
            f"x {mm['slots_per_sandbox']}")
        add(row("", "MiB / slot", "target", "status"))
        add(row("   MemAvailable delta / slots", f"{mm['memavailable_mib_per_slot']:.2f}", "<= 5 MiB",
                verdict(mm["memavailable_mib_per_slot"] <= TARGETS["mib_per_slot"])))
        add(row("   sum of PSS (agents+bwraps+bashes) / slots", f"{mm['pss_mib_per_slot']:.2f}", "<= 5 MiB",
                verdict(mm["pss_mib_per_slot"] <= TARGETS["mib_per_slot"])))
        add(f"      MemAvailable delta {mm['memavailable_delta_mib']:.0f} MiB (Slab +{mm['slab_delta_mib']:.0f}, "
            f"PageTables +{mm['pagetables_delta_mib']:.0f}, Shmem +{mm['shmem_delta_mib']:.0f}); "
            f"PSS total {mm['pss_total_mib']:.0f} MiB")
        for kind, v in sorted(mm["by_kind"].items()):
            add(f"      {kind:<11} x{v['count']:<5} PSS {v['pss_kib'] / 1024:7.1f} MiB "
                f"({v['pss_kib'] / max(v['count'], 1):6.0f} KiB each), RSS {v['rss_kib'] / 1024:7.1f} MiB")
        add(f"      live check: {mm['live_slots']}/{mm['slots']} slots answered `echo $HOSTNAME` correctly "
            f"in one batch ({mm['echo_all_s'] * 1e3:.0f} ms); {mm['spawn_failures']} spawn failures"
            + (f" e.g. {mm['spawn_failure_sample'][:1]}" if mm["spawn_failures"] else ""))
        add(f"      start {mm['sandboxes']} sandboxes: {mm['start_s'] * 1e3:.0f} ms; first `true` in all "
            f"{mm['slots']} slots (spawns every shell): {mm['spawn_all_s'] * 1e3:.0f} ms; "
            f"MemAvailable not returned after stop: {mm['memavailable_not_returned_mib']:.0f} MiB")
        add(row("   all slots live", f"{mm['live_slots']}/{mm['slots']}", f"{mm['slots']}",
                verdict(mm["live_slots"] == mm["slots"])))
        add("")
    cl = res.get("cleanup", {})
    add(f"cleanup: live bwrap {cl.get('bwrap_live')}, zombie bwrap {cl.get('bwrap_zombie')}, "
        f"descendants {cl.get('descendants')}, state dirs {cl.get('state_dirs')}, "
        f"cgroups {cl.get('cgroup_dirs')}")
    add(f"total wall time: {res['wall_s']:.1f} s")
    add("=" * 100)
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------
def timed(label: str, fn: Callable[[], Any]) -> Any:
    log(label)
    t0 = perf()
    out = fn()
    log(f"{label}: {perf() - t0:.1f} s")
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    sections = set(args.sections.split(","))
    res: dict[str, Any] = {"machine": machine(), "quick": q}
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
            lat["swerex"] = timed("a. swe-rex", lambda: asyncio.run(latency_swerex(10 if q else 60, 3 if q else 5)))
        lat["subprocess"] = timed("a. subprocess", lambda: latency_subprocess(100 if q else 500, 10 if q else 30))
        res["latency"] = lat
    if "b" in sections:
        tp: dict[str, Any] = {"ours": []}
        n_slots, n_cmds = (100, 20) if q else (100, 100)
        for sbx in (1, 2):
            tp["ours"].append(timed(f"b. ours {sbx} sandbox(es)",
                                    lambda sbx=sbx: asyncio.run(throughput_ours(n_slots, n_cmds, sbx))))
        n_sub = 500 if q else 3000
        tp["subprocess_threads"] = timed("b. subprocess threads", lambda: throughput_subprocess_threads(n_sub, 16))
        tp["subprocess_asyncio"] = timed("b. subprocess asyncio",
                                         lambda: asyncio.run(throughput_subprocess_asyncio(n_sub, 64)))
        if swerex:
            tp["swerex_threads"] = timed("b. swe-rex threads", lambda: throughput_swerex_threads(
                8 if q else 32, 3 if q else 10))
            if not q:
                tp["swerex_gather"] = timed("b. swe-rex gather",
                                            lambda: asyncio.run(throughput_swerex_gather(4, 4)))
        res["throughput"] = tp
    if "c" in sections:
        res["acquire_release"] = timed("c. acquire/release", lambda: asyncio.run(
            acquire_release(50 if q else 200, 10 if q else 20)))
    if "d" in sections:
        res["cold"] = timed("d. cold start", lambda: asyncio.run(cold_start(3 if q else 7, 10 if q else 30)))
    if "e" in sections:
        slots = args.slots if args.slots is not None else (100 if q else 1000)
        res["memory"] = timed(f"e. memory {slots} slots", lambda: asyncio.run(memory(slots, args.per_sandbox)))
    res["cleanup"] = wait_clean()
    res["wall_s"] = perf() - t_start
    return res


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small, fast run (~15 s)")
    ap.add_argument("--slots", type=int, default=None, help="slots for the memory test (default 1000; 100 with --quick)")
    ap.add_argument("--per-sandbox", type=int, default=100, help="slots per sandbox for the memory test")
    ap.add_argument("--sections", default="a,b,c,d,e", help="which sections to run (default a,b,c,d,e)")
    ap.add_argument("--no-swerex", action="store_true", help="skip the SWE-ReX comparison")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    threading.current_thread().name = "bench"
    res = run(args)
    print(render(res, args.quick), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2, default=str)
    cl = res["cleanup"]
    return 1 if cl["bwrap_live"] or cl["descendants"] else 0


if __name__ == "__main__":
    sys.exit(main())
