"""Engine benchmark: our slot engine vs SWE-ReX's LocalRuntime vs ``subprocess.run``.

Measured in one run, side by side:

a. warm ``echo`` round trip on one slot (median / p90 / p99 ms);
b. throughput: 100 slots x 100 trivial commands (rounds of ``execute_batch``, five runs
   of them and their median, and one big batch), against parallel ``subprocess.run`` and
   parallel SWE-ReX sessions;
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
   of the same sandbox streams ``yes``;
s. scaling (``_scaling.py``, not in the default set): ``--scale-slots`` slots over 1, 2, 4,
   ... sandboxes up to ``--max-sandboxes`` (default twice the CPUs), calls/s against as
   many raw bashes, the ratio, and the CPU per call by part, on the stdlib event loop and
   on uvloop when installed (``--counts 8,16`` for those sandbox counts only, ``--loops
   asyncio`` for one loop); ``--host-processes 2,4`` adds rows of one
   ``ToolBackend(host_processes=K)`` spreading the same sandboxes over 2 and 4 host
   processes, ``--separate-backends 2,4`` rows with them split over 2 and 4 host
   processes each with a ``ToolBackend`` of its own (``_scaling_procs.py``).

Floors measured beside (``_floors.py``): a raw persistent bash answering ``echo`` (a), raw
persistent bashes answering trivial commands in rounds, bare and each in a memory, pids and
cpu cgroup of its own as a slot's shell is (b); bwrap starts and live shells per second (f,
in ``_fresh.py``).

The sections are in ``_engine_sections.py`` (a to e), ``_fresh.py`` (f) and ``streaming.py``
(g); the backends they start and the check for what the run left behind in
``_engine_backends.py``; what is printed in ``_engine_render.py``.

Usage::

    .venv/bin/python benchmarks/engine.py            # full run (~1.5 minutes on 2 cores)
    .venv/bin/python benchmarks/engine.py --quick    # small, fast run (~20 s)
    .venv/bin/python benchmarks/engine.py --slots 500 --json /tmp/bench.json
    .venv/bin/python benchmarks/engine.py --wait-idle 300   # on a shared machine
    .venv/bin/python benchmarks/engine.py --sections s --no-swerex   # scaling with the cores

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared benchmark helpers
import _engine_backends  # noqa: E402 - EXTRA (--disk-limit, --slot-disk)
import streaming  # noqa: E402 - section g
from _engine_backends import FACTS, ORPHANS, reap_orphans, wait_clean  # noqa: E402
from _engine_render import render, summary_ms  # noqa: E402
from _engine_sections import (  # noqa: E402 - sections a to e
    acquire_release,
    cold_start,
    fresh_backend,
    latency_ours,
    memory,
    start_floors,
    throughput_ours,
)
from _floors import raw_bash_echo, raw_bash_throughput  # noqa: E402
from _fresh import bwrap_true_rate, fresh_shells, live_shells_rate  # noqa: E402 - section f
from _machine import log  # noqa: E402
from _peers import (  # noqa: E402 - the peers we compare with
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
    meminfo,
    others_cpu,
)
from _scaling import default_max_sandboxes, scaling  # noqa: E402 - section s
from _scaling import render as render_scaling  # noqa: E402

perf = time.perf_counter


def machine() -> dict[str, Any]:
    """What the numbers were measured on, as ``_engine_render.render`` prints it (run_all.py
    records its own, ``_machine.machine``, with other keys)."""
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


# -- timing each step, and the run ------------------------------------------------------------
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
        n_slots, n_cmds, n_runs = (100, 20, 2) if q else (100, 100, 5)
        for sbx in (1, 2):
            tp["ours"].append(timed(f"b. ours {sbx} sandbox(es)", lambda sbx=sbx: asyncio.run(
                throughput_ours(n_slots, n_cmds, sbx, n_runs))))
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
        res["fresh"] = timed(f"f. fresh shells {n_fresh}", lambda: asyncio.run(fresh_shells(fresh_backend, n_fresh, 100)))
        res["fresh"]["floor"] = timed("f. floor: bwrap true", lambda: bwrap_true_rate(
            find_bwrap(), 100 if q else 400, os.cpu_count() or 2))
        res["fresh"]["live_floor"] = timed("f. floor: live shells", lambda: live_shells_rate(
            find_bwrap(), n_fresh, os.cpu_count() or 2))
    if "g" in sections:
        res["streaming"] = timed("g. streaming", lambda: asyncio.run(
            streaming.measure(20 if q else 100, 100 if q else 300)))
    if "s" in sections:
        counts = [int(x) for x in args.counts.split(",")] if args.counts else None
        procs = [int(x) for x in args.host_processes.split(",")] if args.host_processes else []
        separate = [int(x) for x in args.separate_backends.split(",")] if args.separate_backends else []
        res["scaling"] = scaling(args.scale_slots, args.max_sandboxes or default_max_sandboxes(),
                                 10 if q else 50, 2 if q else 3, timed, counts, args.loops.split(","), procs,
                                 separate)
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
    ap.add_argument("--max-sandboxes", type=int, default=None, metavar="N",
                    help="section s: the most sandboxes (default: twice the CPUs)")
    ap.add_argument("--counts", default=None, metavar="N,N,...",
                    help="section s: these sandbox counts instead of 1, 2, 4, ... --max-sandboxes")
    ap.add_argument("--host-processes", default=None, metavar="K,K,...",
                    help="section s: also one ToolBackend(host_processes=K) spreading each sandbox "
                         "count over K host processes (counts K divides)")
    ap.add_argument("--separate-backends", default=None, metavar="K,K,...",
                    help="section s: also split each sandbox count over K host processes, each with a "
                         "ToolBackend of its own (counts K divides; _scaling_procs.py)")
    ap.add_argument("--loops", default="asyncio,uvloop", metavar="NAMES",
                    help="section s: the event loops to measure (default asyncio,uvloop: uvloop if installed)")
    ap.add_argument("--scale-slots", type=int, default=128, metavar="N",
                    help="section s: slots spread over the sandboxes (default 128)")
    ap.add_argument("--no-swerex", action="store_true", help="skip the SWE-ReX comparison")
    ap.add_argument("--disk-limit", choices=("auto", "kernel", "watch"), default=None,
                    help="every profile's disk_limit (default: the profile default, auto)")
    ap.add_argument("--slot-disk", type=int, default=None, metavar="MIB",
                    help="every profile's slot_disk (default: none, a fair share)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="S",
                    help="first wait up to S seconds for other processes to go quiet (shared machines)")
    args = ap.parse_args(argv)
    if args.disk_limit:
        _engine_backends.EXTRA["disk_limit"] = args.disk_limit
    if args.slot_disk:
        _engine_backends.EXTRA["slot_disk"] = args.slot_disk
    threading.current_thread().name = "bench"
    res = run(args)
    print(render(res, args.quick), flush=True)
    if "scaling" in res:
        print(render_scaling(res["scaling"]), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2, default=str)
    return 0 if res["cleanup"]["clean"] else 1


if __name__ == "__main__":
    sys.exit(main())
