"""Section s of ``engine.py``: how the engine grows with the machine's cores.

The same slots (``--scale-slots``, default 128) spread over 1, 2, 4, ... sandboxes (agent
processes), up to ``--max-sandboxes`` (default twice the CPUs this process may use), each
driven in rounds of ``echo i`` as section b does; beside each sandbox count, as many raw
persistent bashes driven by one Python thread (``_floors.py``, the floor: no sandbox,
agent or host in between), measured right after it so that a shared machine's load drifts
over both alike. Printed: calls/s, the ratio to the floor, and the CPU per call by part
(the host process: its event loop, the pool and the frames; the agents; the shells and
their bubblewrap inits), once with the stdlib event loop and, when ``uvloop`` is installed,
once with uvloop in the same run (the loop the host's ``asyncio`` code runs on, chosen
here explicitly for both, so the comparison does not depend on ``HERMES_MODAL_TOOL_UVLOOP``).

``framing_us``: the host's own share that is frame work, timed in a tight loop apart from
the engine (encode one call's request frame, decode one reply frame, build its
``ExecutionResult``), so that the host's CPU per call splits into that and the rest (the
event loop, the pool, the batch's bookkeeping).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from _engine_backends import cfg, started
from _floors import raw_bash_throughput
from _proc import descendants, host_cpu_s, proc_kind
from _rounds import echo_rounds, warm_up

perf = time.perf_counter


def default_max_sandboxes() -> int:
    """Twice the CPUs this process may run on (``sched_getaffinity``)."""
    return 2 * len(os.sched_getaffinity(0))


def sandbox_counts(max_sandboxes: int) -> list[int]:
    """1, 2, 4, ... up to ``max_sandboxes`` (which ends the list even when not a power of 2)."""
    out, n = [], 1
    while n < max_sandboxes:
        out.append(n)
        n *= 2
    out.append(max_sandboxes)
    return out


def loops(names: Sequence[str] = ("asyncio", "uvloop")) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The event loops to compare, of ``names``: ``asyncio`` (stdlib) and, if importable,
    ``uvloop``."""
    out: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {}
    if "asyncio" in names:
        out["asyncio"] = asyncio.new_event_loop
    if "uvloop" in names:
        try:
            import uvloop
        except ImportError:
            return out
        out["uvloop"] = uvloop.new_event_loop
    return out


def run_on(factory: Callable[[], asyncio.AbstractEventLoop], coro: Coroutine[Any, Any, Any]) -> Any:
    """``asyncio.run`` on a loop made by ``factory`` (Python 3.10 has no ``loop_factory``)."""
    loop = factory()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def cpu_by_kind() -> dict[str, float]:
    """CPU seconds so far of this process ("host") and of its live descendants by kind
    (``_proc.proc_kind``), every thread of each (``/proc/PID/task/*/schedstat``, ns):
    ``_proc.cpu_by_kind`` reads main threads only, and an agent's standby work runs in
    its worker threads. "host" leaves out the walks' own CPU (``_proc.host_cpu_s``)."""
    started = time.process_time()
    out: dict[str, float] = {}
    for pid in descendants(os.getpid()):
        kind = proc_kind(pid)
        total = 0.0
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                    total += int(fh.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
        out[kind] = out.get(kind, 0.0) + total
    out["host"] = host_cpu_s(started)
    return out


async def agents_quiet(since: float, limit_s: float = 30.0, window_s: float = 0.5,
                       cores: float = 0.05) -> float:
    """Wait until the agents' background work after the warm-up is over: each slot's
    first command queues its next layer (standby work, in a worker thread), which waits
    for the CPU to be free for at most ``quiet.BUDGET_S`` seconds and would otherwise run
    in the measured rounds. So: at least that long after ``since`` (a ``perf()`` reading
    taken before the warm-up), then until the agents use less than ``cores`` of a core
    over ``window_s`` (at most ``limit_s`` after ``since``). Returns the seconds waited."""
    from hermes_modal_tool.agent.limits.quiet import BUDGET_S

    t0 = perf()
    await asyncio.sleep(max(0.0, since + BUDGET_S + 0.5 - perf()))
    last = cpu_by_kind().get("agent", 0.0)
    while perf() - since < limit_s:
        await asyncio.sleep(window_s)
        now = cpu_by_kind().get("agent", 0.0)
        if now - last < cores * window_s:
            break
        last = now
    return perf() - t0


@contextlib.asynccontextmanager
async def held_slots(slots: int, sandboxes: int, host_processes: int = 1,
                     ) -> AsyncIterator[tuple[Any, list[Any], float]]:
    """A started backend of ``sandboxes`` sandboxes (spread over ``host_processes``) with
    ``slots`` slots held, spread evenly over them (checked), warm and its agents quiet:
    ``(backend, the slots, the seconds waited for the agents)``; the slots released and
    the backend stopped after. ``one_count`` and each host process of ``_scaling_procs.py``."""
    per = -(-slots // sandboxes)
    b = await started(cfg(slots_per_sandbox=per, min_sandboxes=sandboxes, max_sandboxes=sandboxes,
                          scale_down_idle=False), host_processes)
    try:
        # The pool's default spread (``spread: true``) puts the slots evenly over the
        # sandboxes: checked, since an uneven spread would measure the busiest agent.
        use = [await b.acquire(f"sc-{i}") for i in range(slots)]
        counts = sorted(Counter(s.sandbox_id for s in use).values())
        assert len(counts) == min(sandboxes, slots) and counts[-1] - counts[0] <= 1, counts
        t_warm = perf()
        await warm_up(b, use)
        yield b, use, await agents_quiet(t_warm)
        for s in use:
            await b.release(s)
    finally:
        await b.stop()


def row(sandboxes: int, slots: int, rounds: int, walls: list[float], wrong: int, settle_s: float,
        cpu: dict[str, float]) -> dict[str, Any]:
    """A row of the section: calls/s of the median of the runs (``walls``, seconds each)
    and CPU µs per call by process kind over all runs (``cpu``, seconds)."""
    calls = slots * rounds
    median = sorted(walls)[len(walls) // 2]
    per_call = {k: v / (calls * len(walls)) * 1e6 for k, v in cpu.items() if v > 0}
    return {"sandboxes": sandboxes, "slots": slots, "calls_per_s": calls / median,
            "runs_calls_per_s": [calls / w for w in walls], "wrong_outputs": wrong, "settle_s": settle_s,
            "cpu_us_per_call": per_call}


async def one_count(slots: int, sandboxes: int, rounds: int, runs: int, host_processes: int = 1,
                    ) -> dict[str, Any]:
    """``runs`` runs of ``rounds`` rounds of ``echo i`` over ``slots`` slots spread evenly
    over ``sandboxes`` sandboxes (of one backend over ``host_processes``): calls/s of the
    median run and CPU µs per call by process kind over all runs."""
    walls, wrong, sleeps = [], 0, 0
    cpu: dict[str, float] = {}
    async with held_slots(slots, sandboxes, host_processes) as (b, use, settled_s):
        for _ in range(runs):
            c0, s0 = cpu_by_kind(), resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
            wall, bad = await echo_rounds(b, use, rounds)
            sleeps += resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - s0
            for k, v in cpu_by_kind().items():
                cpu[k] = cpu.get(k, 0.0) + v - c0.get(k, 0.0)
            walls.append(wall)
            wrong += bad
    # The host's sleeps (voluntary context switches: its loop waited for replies) per
    # round: replies that come apart in time cost the host a wake-up each, and it spends
    # about 40% more CPU per call when they do (``host_calls.py --pipes --spread-ms``).
    out = {**row(sandboxes, slots, rounds, walls, wrong, settled_s, cpu),
           "host_sleeps_per_round": sleeps / (rounds * runs)}
    if host_processes > 1:
        out.update(host_processes=host_processes, split="backend")
    return out


def framing_us(n: int = 200, batch: int = 128) -> dict[str, float]:
    """Host µs per call of frame work alone, as a batch of section s sends and gets it: a
    sandbox's ``batch`` calls in one ``calls`` frame (encoded), their results in one
    ``results`` frame (decoded, each made an ExecutionResult). CPU time of this thread, so
    that other processes on a shared machine do not inflate it. Falls back to one frame
    per call where the package has no ``calls`` op (an older tree measured beside)."""
    from hermes_modal_tool import protocol
    from hermes_modal_tool.slots import ExecutionResult, execution_id

    result = protocol.call_result(output="12\n", returncode=0)
    if "calls" not in protocol.OPS:
        msg = {"op": "call", "slot": 7, "tool": "bash", "args": {"command": "echo 12"}, "timeout": 60.0}
        frames = [protocol.encode({"id": i, "ok": True, "result": result}) for i in range(batch)]
        reply = b"".join(frames)

        def encode() -> None:
            for i in range(batch):
                protocol.encode({**msg, "id": i})
    else:
        calls = [[i, i, "bash", {"command": "echo 12"}, 60.0] for i in range(batch)]
        reply = protocol.encode({"id": 0, "results": [[i, protocol.compact_result(result)] for i in range(batch)]})

        def encode() -> None:
            protocol.encode({"id": 0, "op": "calls", "calls": calls})
    dec = protocol.FrameDecoder()
    t0 = time.thread_time()
    for _ in range(n):
        encode()
    t1 = time.thread_time()
    for _ in range(n):
        for m in dec.feed(reply):
            for _mid, r in m.get("results") or [(m["id"], m["result"])]:
                ExecutionResult.from_agent(r, "s_slot_7", execution_id(), "bash")
    t2 = time.thread_time()
    calls_n = n * batch
    return {"encode_request": (t1 - t0) / calls_n * 1e6, "decode_reply_and_result": (t2 - t1) / calls_n * 1e6}


def scaling(slots: int, max_sandboxes: int, rounds: int, runs: int,
            timed: Callable[[str, Callable[[], Any]], Any], counts: Sequence[int] | None = None,
            loop_names: Sequence[str] = ("asyncio", "uvloop"),
            host_processes: Sequence[int] = (), separate: Sequence[int] = ()) -> dict[str, Any]:
    """Section s: for each sandbox count (``counts``, default :func:`sandbox_counts`) and
    each event loop of ``loop_names``, our calls/s and CPU per call by part, and the
    raw-bash floor measured right after (ratio = ours / that floor); with
    ``host_processes``, also one backend spreading the same sandboxes over that many host
    processes (``ToolBackend(host_processes=K)``); with ``separate``, the same sandboxes
    split over that many host processes each with a backend of its own
    (``_scaling_procs.py``). Both: counts that split evenly only."""
    from _engine_backends import EXTRA, OWN_PATHS
    from _scaling_procs import one_count_procs, splits

    rows: list[dict[str, Any]] = []
    for n in counts or sandbox_counts(max_sandboxes):
        mine = []
        for name, factory in loops(loop_names).items():
            row = timed(f"s. ours {n} sandbox(es), {name}", lambda f=factory, n=n: run_on(
                f, one_count(slots, n, rounds, runs)))
            row["loop"] = name
            mine.append(row)
            for k in splits(n, host_processes):
                row = timed(f"s. ours {n} sandbox(es), one backend over {k} host processes, {name}",
                            lambda f=factory, n=n, k=k: run_on(f, one_count(slots, n, rounds, runs, k)))
                row["loop"] = name
                mine.append(row)
            for k in splits(n, separate):
                row = timed(f"s. ours {n} sandbox(es) in {k} separate backends, {name}",
                            lambda name=name, n=n, k=k: one_count_procs(slots, n, k, rounds, runs, name,
                                                                        dict(EXTRA), OWN_PATHS))
                row["loop"] = name
                mine.append(row)
        # The floor does not depend on the sandbox count: measured again beside each, so
        # that a shared machine's load drifts over both alike.
        floor = timed(f"s. floor: {slots} raw bashes", lambda: raw_bash_throughput(slots, rounds * runs))
        for row in mine:
            row["floor_calls_per_s"] = floor["calls_per_s"]
            row["ratio"] = row["calls_per_s"] / floor["calls_per_s"]
            row["floor_cpu_us_per_call"] = floor["cpu_us_per_call"]
            # Each row as soon as it is measured: a later count that fails loses none.
            print(f"  .. s. row: {n} sandbox(es), {_procs(row)} host process(es), "
                  f"{row['loop']}: {row['calls_per_s']:,.0f} calls/s, floor "
                  f"{floor['calls_per_s']:,.0f}, ratio {row['ratio']:.3f}", flush=True)
        rows += mine
    return {"slots": slots, "max_sandboxes": max(counts or [max_sandboxes]), "rounds": rounds, "runs": runs,
            "nproc": len(os.sched_getaffinity(0)), "loadavg": os.getloadavg(),
            "framing_us_per_call": framing_us(), "rows": rows}


#: CPU per call by part; "hmt-host": host processes (``host_processes=K``, or _scaling_procs's).
PARTS = (("host", ("host", "hmt-host")), ("agent", ("agent",)), ("shell", ("bash", "bwrap-init", "bwrap")))


def _procs(row: dict[str, Any]) -> str:
    """The row's host processes: ``K`` (one backend over K) or ``K sep.`` (K backends)."""
    k = row.get("host_processes", 1)
    return f"{k} sep." if k > 1 and row.get("split") != "backend" else str(k)


def render(sc: dict[str, Any]) -> str:
    """The scaling table (markdown) and one JSON line with its figures."""
    fr = sc["framing_us_per_call"]
    lines = [f"s. scaling: {sc['slots']} slots over 1..{sc['max_sandboxes']} sandboxes, "
             f"{sc['runs']} runs of {sc['rounds']} rounds; nproc {sc['nproc']}, load average "
             f"{', '.join(f'{x:.2f}' for x in sc['loadavg'])} (at the end)",
             "",
             "| sandboxes | host processes | loop | calls/s | raw-bash floor | ratio | host µs/call "
             "| agent µs/call | shell µs/call | host sleeps/round |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    short = []
    for r in sc["rows"]:
        cpu = r["cpu_us_per_call"]
        parts = {p: sum(cpu.get(k, 0.0) for k in kinds) for p, kinds in PARTS}
        procs = _procs(r)
        sleeps = r.get("host_sleeps_per_round")
        lines.append(f"| {r['sandboxes']} | {procs} | {r['loop']} | {r['calls_per_s']:,.0f} | {r['floor_calls_per_s']:,.0f} "
                     f"| {r['ratio']:.2f} | {parts['host']:.1f} | {parts['agent']:.1f} | {parts['shell']:.1f} "
                     f"| {'-' if sleeps is None else f'{sleeps:.1f}'} |")
        short.append({"sandboxes": r["sandboxes"], "host_processes": r.get("host_processes", 1),
                      "split": r.get("split"), "loop": r["loop"],
                      "calls_per_s": round(r["calls_per_s"]),
                      "floor": round(r["floor_calls_per_s"]), "ratio": round(r["ratio"], 3),
                      "us_per_call": {p: round(v, 1) for p, v in parts.items()},
                      "host_sleeps_per_round": None if sleeps is None else round(sleeps, 1),
                      # one backend over K host processes: the caller's process (the router)
                      # and the K processes, apart
                      "host_us_by_process": {"router": round(cpu.get("host", 0.0), 1),
                                             "host_processes": round(cpu.get("hmt-host", 0.0), 1)}
                      if r.get("split") == "backend" else None,
                      "wrong": r["wrong_outputs"]})
    lines.append("")
    lines.append(f"host frame work alone: encode a request {fr['encode_request']:.1f} µs, decode a reply and "
                 f"build its result {fr['decode_reply_and_result']:.1f} µs (the rest of host µs/call: the "
                 "event loop, the pool, the batch)")
    lines.append("SCALING_JSON " + json.dumps({"nproc": sc["nproc"], "slots": sc["slots"],
                                               "loadavg": [round(x, 2) for x in sc["loadavg"]],
                                               "framing_us": {k: round(v, 2) for k, v in fr.items()},
                                               "rows": short}))
    return "\n".join(lines)
