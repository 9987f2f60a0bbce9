"""Sections a to e of ``engine.py``: our engine's warm latency, throughput, acquire and
release, cold start (with its floors) and idle memory per slot, each measured on backends
from ``_engine_backends.py``; and the backends section f starts (``_fresh.py`` measures
them). ``engine.py`` runs and times these; ``_engine_render.py`` prints what they return.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

from _engine_backends import PROFILE, cfg, started, track
from _engine_render import summary_ms
from _proc import busy_cpu_s, cpu_by_kind, meminfo, process_memory, quantile
from _rounds import echo_rounds, warm_up

from hermes_modal_tool import ToolBackend

perf = time.perf_counter


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
async def throughput_ours(slots: int, cmds: int, sandboxes: int, repeats: int = 1) -> dict[str, Any]:
    """``repeats`` runs of ``cmds`` rounds of ``echo i`` over ``slots`` slots (one
    ``execute_batch`` per round), then the same calls as one batch. ``rounds_calls_per_s``
    is the median run's (a run takes about a second, and this machine's speed drifts by
    tens of percent from one second to the next: every run is in ``rounds_runs``); the CPU
    per call by process kind is over all the runs."""
    b = await started(cfg(slots_per_sandbox=slots // sandboxes, min_sandboxes=sandboxes,
                        max_sandboxes=sandboxes))
    try:
        ss = [await b.acquire(f"tp-{i}") for i in range(slots)]
        await warm_up(b, ss)  # spawns every slot's shell
        bad = 0
        walls: list[float] = []
        cpu: dict[str, float] = {}  # CPU seconds by process kind, over all the runs
        for _ in range(repeats):
            c0 = cpu_by_kind()
            wall, wrong = await echo_rounds(b, ss, cmds)
            for k, v in cpu_by_kind().items():
                cpu[k] = cpu.get(k, 0.0) + v - c0.get(k, 0.0)
            bad += wrong
            walls.append(wall)
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
    median = sorted(walls, reverse=True)[len(walls) // 2]  # the median run by calls/s: its wall time
    return {"slots": slots, "sandboxes": sandboxes, "calls": total, "repeats": repeats,
            "wrong_outputs": bad, "rounds_s": median,
            "rounds_calls_per_s": total / median, "round_ms": median / cmds * 1e3,
            "rounds_runs": [total / w for w in walls],
            "big_batch_s": big, "big_batch_calls_per_s": total / big,
            "cpu_us_per_call": {k: v / (total * repeats) * 1e6 for k, v in cpu.items()}}


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
async def fresh_backend(per_sandbox: int, sandboxes: int) -> ToolBackend:
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
