"""Load benchmark: many live slots, many trajectories, mixed work, every result checked.

``--trajectories N`` trajectories (default 1000), each holding its own slot for the whole
run (so N slots are live at once, packed ``--slots-per-sandbox`` to a sandbox), each
running ``--steps M`` steps (default 50). A step is one of:

- shell builtins only (``read``, ``echo``, arithmetic, ``$HOSTNAME``);
- a short process (``python3 -c ...``);
- ``write_file`` then ``cat`` of that file (two calls of one batch, same slot, in order);
- a failing command (exit code 3);
- about 1 in 200 (``--timeout-every``): ``sleep 5`` with ``timeout: 1`` (must come back
  as exit code 124, with the output printed before the timeout, and nothing after it).

Step 0 writes the trajectory's name to ``.owner`` and exports it. Every step's output
names its trajectory and step, the slot's hostname (``slot-N``), the owner file and the
exported variable, and is compared with exactly what that trajectory's slot must print:
a result that went to the wrong trajectory, the wrong slot or the wrong step is counted
as *misrouted*; a missing result, an exception or an unexpected failure as *lost*;
anything else that differs as *wrong*. All three must be zero.

Two ways of driving the trajectories (``--mode``):

- ``tasks`` (default): one asyncio task per trajectory, each calling ``execute_batch``
  for its own step, as an RL trainer's rollout workers do: every trajectory moves at its
  own pace, and one trajectory's timeout does not hold up the others. Latency here is
  what each caller sees per step.
- ``lockstep``: one ``execute_batch`` per step across all trajectories (a synchronous
  trainer). Each step lasts as long as its slowest call, so with 1000 trajectories and
  1 timeout in 200 nearly every step waits out a 1 s timeout; latency is per step batch.

Printed: wall time, throughput (calls/s), latency p50/p99/p99.9, each command's own run
time as the agent measured it (``duration_s``: the clock its timeout runs on, which starts
after the call has waited for admission and for its slot's shell), the MemAvailable
low-water mark during the run (sampled every 0.2 s) and
the PSS of our processes (the host process, agents, bwraps, shells, commands; sampled
every few seconds, the peak is shown), and after ``stop()`` everything this run left
behind: processes, cgroups, mounts, state directories. Exit status 1 if any result was
lost, misrouted or wrong, or anything was left behind.

The steps and the check of their results are in ``_load_work.py``; what the run left
behind and its memory are watched by ``_load_footprint.py``.

Usage::

    .venv/bin/python benchmarks/load.py                       # 1000 x 50
    .venv/bin/python benchmarks/load.py --quick               # 100 x 10
    .venv/bin/python benchmarks/load.py --trajectories 200 --steps 20 --mode lockstep
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

from hermes_modal_tool import SandboxConfig, Slot, ToolBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared benchmark helpers
from _load_footprint import ORPHANS_REAPED, Footprint, MemorySampler  # noqa: E402
from _load_work import Tally, step_calls  # noqa: E402
from _proc import become_subreaper, meminfo, quantile  # noqa: E402

perf = time.perf_counter


# -- the run ------------------------------------------------------------------------------------

async def run_load(trajectories: int = 1000, steps: int = 50, slots_per_sandbox: int = 100,
                   mode: str = "tasks", timeout_every: int = 200, seed: int = 1,
                   memory_mib: int = 4096, pss_every: float = 5.0, reap: bool = False,
                   log=lambda msg: None) -> dict[str, Any]:
    """Run the load; return the numbers and the leak check (see the module docstring)."""
    sandboxes = -(-trajectories // slots_per_sandbox)
    profile = f"load{os.getpid()}x{uuid.uuid4().hex[:6]}"
    config = SandboxConfig(name=profile, slots_per_sandbox=slots_per_sandbox, min_sandboxes=sandboxes,
                           max_sandboxes=sandboxes, memory=memory_mib, execution_timeout_s=60,
                           acquire_timeout_s=120, scale_down_idle=False)
    mem_before = meminfo()["MemAvailable"]
    sampler = MemorySampler(pss_every, reap)
    sampler.start()
    tally = Tally()
    backend = ToolBackend(config)
    res: dict[str, Any] = {"trajectories": trajectories, "steps": steps, "mode": mode,
                           "sandboxes": sandboxes, "slots_per_sandbox": slots_per_sandbox,
                           "timeout_every": timeout_every}
    fp = None
    try:
        t0 = perf()
        await backend.start()
        fp = Footprint(backend)
        slots: list[Slot] = [await backend.acquire(f"T{t}") for t in range(trajectories)]
        res["start_and_acquire_s"] = perf() - t0
        log(f"{sandboxes} sandboxes up, {len(slots)} slots held in {res['start_and_acquire_s']:.1f}s")
        assert len({(s.sandbox_id, s.index) for s in slots}) == trajectories
        calls = 0
        t0 = perf()
        if mode == "lockstep":
            for s in range(steps):
                plan = [(t, step_calls(t, s, slots[t].index, seed, timeout_every)) for t in range(trajectories)]
                reqs = [(slots[t], c.tool, c.args) for t, cs in plan for c in cs]
                b0 = perf()
                try:
                    results: list[Any] = await backend.execute_batch(reqs)
                except Exception as exc:  # noqa: BLE001 - counted as lost
                    results = [exc] * len(reqs)
                took = perf() - b0
                tally.latencies.append(took)  # one per step batch, whatever its size
                i = 0
                for t, cs in plan:
                    for c in cs:
                        tally.check(t, s, c, results[i])
                        i += 1
                calls += len(reqs)
                if s == 0:
                    res["first_step_s"] = took  # spawns every slot's shell
                if s % 10 == 0 or s == steps - 1:
                    log(f"step {s + 1}/{steps}: {took:.2f}s, {calls} calls, {tally.ok} ok")
        else:
            done_steps = 0

            async def trajectory(t: int) -> int:
                nonlocal done_steps
                n = 0
                slot = slots[t]
                for s in range(steps):
                    cs = step_calls(t, s, slot.index, seed, timeout_every)
                    b0 = perf()
                    try:
                        results = await backend.execute_batch([(slot, c.tool, c.args) for c in cs])
                    except Exception as exc:  # noqa: BLE001 - counted as lost
                        results = [exc] * len(cs)
                    took = perf() - b0
                    tally.latencies.append(took)  # one per step (a write step has two calls)
                    for c, r in zip(cs, results, strict=True):
                        tally.check(t, s, c, r)
                    n += len(cs)
                    done_steps += 1
                return n

            async def progress() -> None:
                while True:
                    await asyncio.sleep(15)
                    log(f"{done_steps}/{trajectories * steps} steps, {tally.ok} ok, "
                        f"{perf() - t0:.0f}s")

            reporter = asyncio.ensure_future(progress())
            try:
                counts = await asyncio.gather(*(trajectory(t) for t in range(trajectories)))
            finally:
                reporter.cancel()
                await asyncio.gather(reporter, return_exceptions=True)
            calls = sum(counts)
        wall = perf() - t0
        pss, n = await asyncio.to_thread(sampler.pss_now)
        if pss > sampler.pss_peak_kib:
            sampler.pss_peak_kib, sampler.pss_peak_procs = pss, n
        res["mem_end_of_run"] = {"pss_mib": pss / 1024, "processes": n}
        status = backend.get_status()
        res["status"] = {k: status[k] for k in ("sandboxes", "total_slots", "calls", "failures", "timeouts")}
        res["status"]["sandboxes_died"] = status["pools"][profile]["sandboxes_died"]
        for s in slots:
            await backend.release(s)
        res.update(calls=calls, wall_s=wall, calls_per_s=calls / wall,
                   steps_per_s=trajectories * steps / wall)
    finally:
        if fp is None:
            try:
                fp = Footprint(backend)
            except Exception:  # noqa: BLE001 - no driver was made
                fp = None
        t1 = perf()
        await backend.stop()
        res["stop_s"] = perf() - t1
        sampler.stop()
    res["leftovers"] = await asyncio.to_thread(fp.settled, 5.0, reap) if fp else {}
    res["clean"] = not any(res["leftovers"].values())
    res["orphans_reaped"] = ORPHANS_REAPED[0]
    res.update(ok=tally.ok, lost=tally.lost, misrouted=tally.misrouted, wrong=tally.wrong,
               by_kind=tally.by_kind, problems=tally.samples, reasons=tally.reasons)
    lat = tally.latencies
    res["latency_ms"] = {q: quantile(lat, v) * 1e3 for q, v in (("p50", .5), ("p99", .99), ("p99.9", .999))}
    res["latency_ms"]["max"] = max(lat) * 1e3 if lat else math.nan
    ag = tally.agent_s
    res["agent_ms"] = {q: quantile(ag, v) * 1e3 for q, v in (("p50", .5), ("p99", .99), ("p99.9", .999))}
    res["mem"] = {"memavailable_before_mib": mem_before / 1024,
                  "memavailable_low_mib": sampler.low_kib / 1024,
                  "memavailable_drop_mib": (mem_before - sampler.low_kib) / 1024,
                  "pss_peak_mib": sampler.pss_peak_kib / 1024,
                  "pss_peak_processes": sampler.pss_peak_procs,
                  "pss_peak_mib_per_slot": sampler.pss_peak_kib / 1024 / trajectories}
    return res


def render(res: dict[str, Any]) -> str:
    lat, ag, mem = res["latency_ms"], res["agent_ms"], res["mem"]
    unit = "per step batch" if res["mode"] == "lockstep" else "per trajectory step"
    lines = [
        f"load: {res['trajectories']} trajectories x {res['steps']} steps, mode {res['mode']}, "
        f"{res['sandboxes']} sandboxes x {res['slots_per_sandbox']} slots, timeout 1 in {res['timeout_every']}",
        f"  start + acquire {res.get('start_and_acquire_s', math.nan):.1f}s; run {res.get('wall_s', math.nan):.1f}s; "
        f"stop {res['stop_s']:.1f}s",
        f"  calls {res.get('calls', 0)}  ({res.get('calls_per_s', math.nan):.0f} calls/s, "
        f"{res.get('steps_per_s', math.nan):.0f} steps/s); by kind {json.dumps(res['by_kind'])}",
        f"  results: ok {res['ok']}, lost {res['lost']}, misrouted {res['misrouted']}, wrong {res['wrong']}",
        f"  latency ({unit}): p50 {lat['p50']:.1f} ms, p99 {lat['p99']:.1f} ms, "
        f"p99.9 {lat['p99.9']:.1f} ms, max {lat['max']:.1f} ms",
        f"  command run time (its timeout clock; not the wait to start): p50 {ag['p50']:.1f} ms, "
        f"p99 {ag['p99']:.1f} ms, p99.9 {ag['p99.9']:.1f} ms",
        f"  memory: MemAvailable {mem['memavailable_before_mib']:.0f} MiB before, low-water "
        f"{mem['memavailable_low_mib']:.0f} MiB (-{mem['memavailable_drop_mib']:.0f} MiB); "
        f"PSS of our processes peak {mem['pss_peak_mib']:.0f} MiB over {mem['pss_peak_processes']} processes "
        f"({mem['pss_peak_mib_per_slot']:.2f} MiB per slot)",
        f"  engine status at the end: {json.dumps(res.get('status', {}))}",
        f"  slot processes orphaned (re-parented to this subreaper, reaped): {res.get('orphans_reaped', 0)}",
        f"  after stop(): {'nothing left' if res['clean'] else 'LEFT BEHIND: ' + json.dumps(res['leftovers'])}",
    ]
    for k, v in sorted(res["reasons"].items(), key=lambda kv: -kv[1])[:12]:
        lines.append(f"  ! {v} x {k}")
    for p in res["problems"]:
        lines.append(f"  ! {p}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trajectories", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--slots-per-sandbox", type=int, default=100)
    ap.add_argument("--mode", choices=("tasks", "lockstep"), default="tasks")
    ap.add_argument("--timeout-every", type=int, default=200, help="1 step in N is a timeout (0: none)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="100 trajectories x 10 steps")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args(argv)
    if args.quick:
        args.trajectories, args.steps = min(args.trajectories, 100), min(args.steps, 10)

    def log(msg: str) -> None:
        print(f"  .. {msg}", file=sys.stderr, flush=True)

    t0 = perf()
    res = asyncio.run(run_load(args.trajectories, args.steps, args.slots_per_sandbox, args.mode,
                               args.timeout_every, args.seed, reap=become_subreaper(), log=log))
    res["total_s"] = perf() - t0
    print(render(res))
    print(f"  total {res['total_s']:.1f}s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1, default=str)
    bad = res["lost"] or res["misrouted"] or res["wrong"] or not res["clean"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
