"""Every benchmark and every peer in one run: a JSON report, PNG plots, benchmarks/README.md.

Runs ``engine.py``, ``modal_rpc.py`` and ``load.py`` as subprocesses (``--json``) and, in
this process, the measurements no other script makes, each system beside its peers:

- latency: the raw time of ``echo hi`` calls, interleaved in blocks across every system:
  ours (local driver), ours (Modal driver), the original slot backend's and
  ``langchain-modal``'s exec per command (both over the package's local Modal control
  plane), a SWE-ReX ``LocalRuntime`` session and ``subprocess.run``; stored as quantiles
  and a log-spaced histogram, with the RPCs per command of the Modal ones;
- throughput against the number of slots (rounds of ``execute_batch``; the peers at the
  same concurrency: a thread pool of N for ``subprocess.run``, N SWE-ReX sessions in
  threads, N concurrent execs), and against ``slots_per_sandbox`` (a fixed slot count
  packed into 1..N sandboxes), with the memory of each layout;
- the memory of an idle SWE-ReX session (the peer of an idle slot).

Usage::

    .venv/bin/python benchmarks/run_all.py            # full run (~14 min on 2 cores)
    .venv/bin/python benchmarks/run_all.py --quick    # everything small (~2 min)
    .venv/bin/python benchmarks/run_all.py --smoke --out /tmp/r   # ~30 s; for the tests
    .venv/bin/python benchmarks/run_all.py --skip load,engine --out /tmp/r

Writes ``OUT/report.json`` (default ``benchmarks/results/``), the plots ``OUT/*.png``, and
the README generated from the report: ``benchmarks/README.md`` when OUT is the default,
else ``OUT/README.md``. It prints a short table for the top-level README; every number
in both comes from ``report.json`` (``_report.render_readme`` rebuilds the README from it;
``_report.py`` makes the plots and the markdown, this file measures).
A full run first waits (``--wait-idle``, up to 15 min) for a quiet machine (the 1-minute
load average below ``--max-load`` and fewer than ``--max-busy`` cores busy), and before each
section up to 3 min for the cores (``--wait-between``); the load and the cores busy
elsewhere during each section are in the report, since anything else running on the
machine skews the numbers. SIGTERM stops every backend on the way out, as Ctrl-C does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared benchmark helpers and the other benchmarks
import engine  # noqa: E402
from _machine import READ_ONLY_GIT, LoadSampler, log, machine, section, wait_quiet  # noqa: E402
from _proc import become_subreaper, meminfo, quantile  # noqa: E402
from _report import (  # noqa: E402
    HIST_LO_S,
    HIST_PER_DECADE,
    SCRIPTS,
    SYSTEMS,
    headline,
    md_table,
    render_readme,
    render_top_table,
)
from _report_plots import plot_latency, plot_memory, plot_rpcs, plot_slots, plot_sps  # noqa: E402

from hermes_modal_tool import ModalSandboxConfig, SandboxConfig, ToolBackend  # noqa: E402

perf = time.perf_counter
PROFILE = f"ra{os.getpid()}"
DEFAULT_OUT = HERE / "results"
COMMAND = "echo hi"
OWN = ("latency", "slots", "sps", "peer_memory", "agents_sdk")
QS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0)


@dataclass(frozen=True)
class Sizes:
    """How big each measurement is, per mode."""

    lat_fast: int  # calls per fast system (ours, subprocess.run)
    lat_slow: int  # calls per slow system (exec per command, SWE-ReX)
    lat_blocks: int  # the systems take turns this many times
    slots: tuple[int, ...]  # throughput against slots: ours (local driver)
    modal_slots: tuple[int, ...]  # ... ours (Modal driver)
    exec_slots: tuple[int, ...]  # ... concurrent execs per command
    swerex_slots: tuple[int, ...]  # ... SWE-ReX sessions in threads
    tp_calls: int  # calls per throughput point (at least tp_rounds rounds)
    tp_rounds: int
    per_sandbox: int  # slots_per_sandbox of the slot sweep
    sps_slots: int  # slots of the slots_per_sandbox sweep
    sps_sandboxes: tuple[int, ...]
    sps_rounds: int
    swerex_sessions: int  # sessions for the SWE-ReX memory measurement
    engine: tuple[str, ...]
    modal_rpc: tuple[str, ...]
    load: tuple[str, ...]


SIZES = {
    "full": Sizes(2000, 200, 10, (1, 10, 50, 100, 200, 400), (1, 10, 50, 100, 200, 400),
                  (1, 10, 50), (1, 10, 50), 8000, 10, 100, 200, (1, 2, 4, 10, 50, 200), 40, 20,
                  (), (), ()),
    "quick": Sizes(300, 30, 5, (1, 10, 100, 400), (1, 10, 100), (1, 10), (1, 10), 1000, 5,
                   100, 200, (1, 10, 200), 5, 5, ("--quick",), ("--quick",), ("--quick",)),
    "smoke": Sizes(20, 3, 1, (1, 4), (1, 4), (1, 2), (1,), 40, 2, 4, 4, (1, 4), 2, 2,
                   ("--quick", "--sections", "e", "--slots", "10", "--per-sandbox", "10",
                    "--no-swerex"),
                   ("--quick", "--commands", "5", "--rounds", "1", "--starts", "1",
                    "--budget", "5"),
                   ("--quick", "--trajectories", "10", "--steps", "3",
                    "--slots-per-sandbox", "10")),
}


def compact(x: Any, digits: int = 5) -> Any:
    """JSON-safe and small: NaN/inf to None, floats to ``digits`` significant digits,
    lists longer than 100 cut to their first 20 items and a note of how many were left out."""
    if isinstance(x, float):
        return None if not math.isfinite(x) else float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {str(k): compact(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        if len(x) > 100:
            return [compact(v, digits) for v in x[:20]] + [f"... {len(x) - 20} more"]
        return [compact(v, digits) for v in x]
    return x


# -- the existing scripts -------------------------------------------------------------------
def run_script(name: str, args: Sequence[str], tmp: Path, timeout: float,
               python: str = sys.executable) -> dict[str, Any]:
    """Run ``benchmarks/NAME.py ARGS --json`` with ``python``; its JSON, exit status and
    wall time."""
    out, logf = tmp / f"{name}.json", tmp / f"{name}.log"
    argv = [python, str(HERE / f"{name}.py"), *args, "--json", str(out)]
    t0 = perf()
    with open(logf, "w") as fh:
        try:
            rc: int | str = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT,
                                           env=READ_ONLY_GIT, timeout=timeout,
                                           check=False).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {timeout:.0f} s"
    res: dict[str, Any] = {"argv": ["benchmarks/" + f"{name}.py", *args], "exit": rc,
                           "wall_s": perf() - t0}
    try:
        with open(out) as fh:
            res["result"] = json.load(fh)
    except (OSError, ValueError) as exc:
        res["error"] = f"no JSON ({type(exc).__name__}); output ends: " + logf.read_text()[-1500:]
    if rc != 0:
        log(f"{name}.py exited with {rc}; output ends:\n{logf.read_text()[-1500:]}")
    return res


#: agents_sdk.py's size per run mode (commands in its exec loop).
AGENTS_SDK_ARGS = {"full": ("--commands", "200"), "quick": ("--commands", "50"),
                   "smoke": ("--commands", "5")}
AGENTS_VENV_PYTHON = HERE.parent / ".venv-agents" / "bin" / "python"


def run_agents_sdk(mode: str, tmp: Path) -> dict[str, Any]:
    """The OpenAI Agents SDK's Modal sandbox client against ours, both over the local Modal
    control plane (agents_sdk.py). The SDK needs openai>=3, which cannot share .venv with
    hermes-agent: it runs with .venv-agents' Python (``bash scripts/setup.sh agents``)."""
    if not AGENTS_VENV_PYTHON.exists():
        log("agents_sdk: no .venv-agents (bash scripts/setup.sh agents); skipped")
        return {"skipped": "no .venv-agents: run `bash scripts/setup.sh agents`"}
    return run_script("agents_sdk", AGENTS_SDK_ARGS[mode], tmp, 900, str(AGENTS_VENV_PYTHON))


# -- measured here: latency ------------------------------------------------------------------
def distribution(xs: Sequence[float]) -> dict[str, Any]:
    """Quantiles (ms) and a sparse log-spaced histogram (bin index -> count) of seconds."""
    hist: dict[str, int] = {}
    for x in xs:
        i = max(0, math.floor(math.log10(max(x, HIST_LO_S) / HIST_LO_S) * HIST_PER_DECADE))
        hist[str(i)] = hist.get(str(i), 0) + 1
    return {"n": len(xs), "ms": {f"p{q * 100:g}": quantile(xs, q) * 1e3 for q in QS},
            "mean_ms": sum(xs) / len(xs) * 1e3 if xs else math.nan,
            "hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0])))}


@contextlib.asynccontextmanager
async def backend(config: SandboxConfig) -> Any:
    """A started backend, stopped at the end (also when starting fails)."""
    b = ToolBackend(config)
    try:
        await b.start()
        yield b
    finally:
        await b.stop()


@contextlib.contextmanager
def modal_server() -> Iterator[Any]:
    """The local Modal control plane on a thread, with the SDK's environment pointed at it."""
    from hermes_modal_tool.testing.modal_server import serve_for_this_process

    with serve_for_this_process() as server:
        yield server


def langchain_execute(sb: Any) -> tuple[Callable[[str], str], str]:
    """``langchain_modal.ModalSandbox(sandbox=sb).execute`` (output only), or, if that package
    is not installed, its call sequence reproduced with the SDK; and which one it is."""
    try:
        from langchain_modal import ModalSandbox
    except ImportError:
        def execute(cmd: str) -> str:  # the calls of langchain_modal 0.0.7 ModalSandbox.execute
            p = sb.exec("bash", "-c", cmd, timeout=30 * 60)
            p.wait()
            return (p.stdout.read() or "") + p.stderr.read()
        return execute, "its call sequence reproduced with the SDK (package not installed)"
    from importlib.metadata import version
    be = ModalSandbox(sandbox=sb)
    return (lambda cmd: be.execute(cmd).output), f"langchain-modal {version('langchain-modal')}"


def timed_sync(fn: Callable[[], Any], expect: str) -> float:
    """Seconds one blocking call takes (timed on the thread that runs it)."""
    t0 = perf()
    out = fn()
    dt = perf() - t0
    if out != expect:
        raise RuntimeError(f"unexpected output {out!r}")
    return dt


async def latency(sizes: Sizes, server: Any) -> dict[str, Any]:
    """Every system's ``echo hi`` in turns (blocks), so a change of load hits all alike."""
    import modal
    import modal_rpc

    xs: dict[str, list[float]] = {k: [] for k in SYSTEMS}
    res: dict[str, Any] = {"command": COMMAND, "systems": {}}
    async with contextlib.AsyncExitStack() as stack:
        calls: dict[str, Callable[[], Any]] = {}  # key -> coroutine function -> seconds
        b = await stack.enter_async_context(backend(SandboxConfig(
            name=f"{PROFILE}l", slots_per_sandbox=4, min_sandboxes=1, max_sandboxes=1)))
        slot = await b.acquire("latency")
        bm = await stack.enter_async_context(backend(ModalSandboxConfig(
            name=f"{PROFILE}m", slots_per_sandbox=4, min_sandboxes=1, max_sandboxes=1)))
        mslot = await bm.acquire("latency")

        def ours(bk: ToolBackend, s: Any) -> Callable[[], Any]:
            async def call() -> float:
                t0 = perf()
                [r] = await bk.execute_batch([(s, "bash", {"command": COMMAND})])
                dt = perf() - t0
                if r.output != "hi\n":
                    raise RuntimeError(f"unexpected result {r}")
                return dt
            return call

        calls["ours_local"], calls["ours_modal"] = ours(b, slot), ours(bm, mslot)
        app = await modal.App.lookup.aio(f"{PROFILE}-execs", create_if_missing=True)
        sb = await modal.Sandbox.create.aio(app=app, image=modal.Image.from_registry("python:3.11"))
        stack.push_async_callback(sb.terminate.aio)

        async def original() -> float:
            t0 = perf()
            out, _err, code = await modal_rpc.exec_once(sb, COMMAND)
            dt = perf() - t0
            if (out, code) != ("hi\n", 0):
                raise RuntimeError(f"unexpected result {out!r} {code}")
            return dt

        calls["exec_original"] = original
        lc_execute, res["langchain_modal_how"] = langchain_execute(sb)
        calls["langchain_modal"] = lambda: asyncio.to_thread(
            timed_sync, lambda: lc_execute(COMMAND), "hi\n")
        LocalRuntime, Create, BashAction, _ = engine._swerex_imports()
        rt = LocalRuntime()
        t0 = perf()
        await rt.create_session(Create(session="lat", startup_timeout=30.0))
        res["swerex_session_create_ms"] = (perf() - t0) * 1e3
        stack.push_async_callback(rt.close)
        action = BashAction(command=COMMAND, session="lat")

        async def swerex() -> float:
            t0 = perf()
            obs = await rt.run_in_session(action)
            dt = perf() - t0
            if obs.output.strip() != "hi":
                raise RuntimeError(f"unexpected output {obs.output!r}")
            return dt

        calls["swerex"] = swerex
        calls["subprocess"] = lambda: asyncio.to_thread(
            timed_sync, lambda: subprocess.run(["bash", "-c", COMMAND], capture_output=True,
                                               text=True, check=False).stdout, "hi\n")
        slow = {"exec_original", "langchain_modal", "swerex"}
        errors: dict[str, list[str]] = {k: [] for k in SYSTEMS}

        async def attempt(key: str, keep: bool = True) -> None:
            """One call; a failure is counted (SWE-ReX gives up on a slow prompt after 1 s),
            and a system that failed 20 times takes no more turns."""
            if len(errors[key]) >= 20:
                return
            try:
                dt = await calls[key]()
            except Exception as exc:  # noqa: BLE001 - reported with the system's numbers
                errors[key].append(f"{type(exc).__name__}: {exc}"[:200])
                return
            if keep:
                xs[key].append(dt)

        for key in calls:  # warm-up
            for _ in range(3 if key in slow else 20):
                await attempt(key, keep=False)
        for _ in range(sizes.lat_blocks):
            for key in calls:
                n = (sizes.lat_slow if key in slow else sizes.lat_fast) // sizes.lat_blocks
                for _ in range(max(n, 1)):
                    await attempt(key)
        # RPCs per command of the Modal ones, each alone (the server counts every RPC)
        rpcs = {}
        for key in ("ours_modal", "exec_original", "langchain_modal"):
            server.reset_counts()
            n = max(sizes.lat_slow // 4, 3)
            for _ in range(n):
                await calls[key]()
            await asyncio.sleep(0.1)
            rpcs[key] = {"rpcs": {k: v / n for k, v in sorted(server.rpc_counts.items())},
                         "stream_messages": {k: v / n for k, v in
                                             sorted(server.stream_messages.items())},
                         "n": n}
    for key in SYSTEMS:
        res["systems"][key] = {**distribution(xs[key]), "errors": len(errors[key]),
                               "error_sample": errors[key][:2],
                               **({"per_command": rpcs[key]} if key in rpcs else {})}
    return res


# -- measured here: throughput against slots and against slots_per_sandbox -----------------------
async def tp_ours(config: SandboxConfig, slots: int, sizes: Sizes, rounds: int | None = None,
                  memory: bool = False) -> dict[str, Any]:
    """Rounds of one ``execute_batch`` over ``slots`` slots (``echo i``), after 3 warm-up
    rounds (which start every slot's shell); optionally the PSS of every process."""
    rounds = rounds or max(sizes.tp_rounds, -(-sizes.tp_calls // slots))
    t0 = perf()
    async with backend(config) as b:
        ss = [await b.acquire(f"tp{i}") for i in range(slots)]
        start_s = perf() - t0
        for _ in range(3):
            rs = await b.execute_batch([(s, "bash", {"command": "true"}) for s in ss])
            if not all(r.success for r in rs):
                raise RuntimeError(next(r for r in rs if not r.success))
        mem = await asyncio.to_thread(engine.process_memory) if memory else None
        wrong = 0
        t0 = perf()
        for i in range(rounds):
            rs = await b.execute_batch([(s, "bash", {"command": f"echo {i}"}) for s in ss])
            wrong += sum(r.output != f"{i}\n" for r in rs)
        dt = perf() - t0
        for s in ss:
            await b.release(s)
    out = {"slots": slots, "sandboxes": config.min_sandboxes,
           "slots_per_sandbox": config.slots_per_sandbox, "rounds": rounds,
           "calls": rounds * slots, "seconds": dt, "calls_per_s": rounds * slots / dt,
           "round_ms": dt / rounds * 1e3, "wrong_outputs": wrong, "start_and_acquire_s": start_s}
    if mem is not None:
        pss = sum(v["pss_kib"] for v in mem.values())
        out.update(pss_mib_per_slot=pss / 1024 / slots,
                   processes={k: v["count"] for k, v in mem.items()})
    return out


def tp_subprocess(workers: int, sizes: Sizes) -> dict[str, Any]:
    calls = max(workers * sizes.tp_rounds, sizes.tp_calls // 4)
    r = engine.throughput_subprocess_threads(calls, workers)
    return {"slots": workers, **r}


async def tp_exec(sb: Any, concurrent: int, sizes: Sizes) -> dict[str, Any]:
    """Rounds of ``concurrent`` execs per command at once on one sandbox (the original's way)."""
    import modal_rpc

    rounds = max(sizes.tp_rounds, -(-sizes.tp_calls // 40 // concurrent))
    await asyncio.gather(*(modal_rpc.exec_once(sb, "true") for _ in range(concurrent)))
    wrong = 0
    t0 = perf()
    for i in range(rounds):
        rs = await asyncio.gather(*(modal_rpc.exec_once(sb, f"echo {i}")
                                    for _ in range(concurrent)))
        wrong += sum(out != f"{i}\n" for out, _, _ in rs)
    dt = perf() - t0
    return {"slots": concurrent, "rounds": rounds, "calls": rounds * concurrent, "seconds": dt,
            "calls_per_s": rounds * concurrent / dt, "wrong_outputs": wrong}


async def tp_modal(sizes: Sizes) -> dict[str, list[dict[str, Any]]]:
    import modal

    out: dict[str, list[dict[str, Any]]] = {"ours_modal": [], "exec_original": []}
    for n in sizes.modal_slots:
        sbx = -(-n // sizes.per_sandbox)
        config = ModalSandboxConfig(name=f"{PROFILE}mt",
                                    slots_per_sandbox=min(n, sizes.per_sandbox),
                                    min_sandboxes=sbx, max_sandboxes=sbx, scale_down_idle=False)
        out["ours_modal"].append(await tp_ours(config, n, sizes))
        log(f"   ours (Modal driver), {n} slots: {out['ours_modal'][-1]['calls_per_s']:,.0f}/s")
    app = await modal.App.lookup.aio(f"{PROFILE}-tp", create_if_missing=True)
    sb = await modal.Sandbox.create.aio(app=app, image=modal.Image.from_registry("python:3.11"))
    try:
        for n in sizes.exec_slots:
            out["exec_original"].append(await tp_exec(sb, n, sizes))
            log(f"   exec per command, {n} at once: "
                f"{out['exec_original'][-1]['calls_per_s']:,.0f}/s")
    finally:
        await sb.terminate.aio()
    return out


def throughput_vs_slots(sizes: Sizes) -> dict[str, Any]:
    res: dict[str, Any] = {"per_sandbox": sizes.per_sandbox, "command": "echo i",
                           "ours_local": [], "subprocess": [], "swerex": []}
    for n in sizes.slots:
        sbx = -(-n // sizes.per_sandbox)
        config = SandboxConfig(name=f"{PROFILE}t", slots_per_sandbox=min(n, sizes.per_sandbox),
                               min_sandboxes=sbx, max_sandboxes=sbx, scale_down_idle=False)
        res["ours_local"].append(asyncio.run(tp_ours(config, n, sizes)))
        log(f"   ours (local driver), {n} slots: {res['ours_local'][-1]['calls_per_s']:,.0f}/s")
        res["subprocess"].append(tp_subprocess(n, sizes))
        log(f"   subprocess.run, {n} threads: {res['subprocess'][-1]['calls_per_s']:,.0f}/s")
    for n in sizes.swerex_slots:
        cmds = max(sizes.tp_rounds, min(50, sizes.tp_calls // 80 // n))
        try:
            r = engine.throughput_swerex_threads(n, cmds)
        except Exception as exc:  # noqa: BLE001 - SWE-ReX gives up on a slow prompt
            res.setdefault("swerex_failed", []).append(
                {"slots": n, "error": f"{type(exc).__name__}: {exc}"[:200]})
            log(f"   SWE-ReX, {n} sessions in threads: failed ({type(exc).__name__})")
            continue
        res["swerex"].append({"slots": n, **r})
        log(f"   SWE-ReX, {n} sessions in threads: {r['calls_per_s']:,.1f}/s "
            f"({r['ok']}/{r['calls']} correct)")
    with modal_server():
        res.update(asyncio.run(tp_modal(sizes)))
    return res


def throughput_vs_sps(sizes: Sizes) -> dict[str, Any]:
    res: dict[str, Any] = {"slots": sizes.sps_slots, "layouts": []}
    for sbx in sizes.sps_sandboxes:
        per = sizes.sps_slots // sbx
        config = SandboxConfig(name=f"{PROFILE}s", slots_per_sandbox=per, min_sandboxes=sbx,
                               max_sandboxes=sbx, scale_down_idle=False, execution_timeout_s=120)
        r = asyncio.run(tp_ours(config, per * sbx, sizes, rounds=sizes.sps_rounds, memory=True))
        res["layouts"].append(r)
        log(f"   {sbx} x {per}: {r['calls_per_s']:,.0f}/s, {r['pss_mib_per_slot']:.2f} MiB/slot")
    return res


async def swerex_memory(sessions: int) -> dict[str, Any]:
    """PSS of ``sessions`` idle SWE-ReX sessions: their shells, and this process's growth."""
    LocalRuntime, Create, _, _ = engine._swerex_imports()
    own0 = engine.pss_kib(os.getpid())[0]
    before = await asyncio.to_thread(engine.process_memory)
    rt = LocalRuntime()
    try:
        for i in range(sessions):  # each starts its bash (pexpect) and waits for the prompt
            await rt.create_session(Create(session=f"m{i}", startup_timeout=30.0))
        await asyncio.sleep(1.0)
        after = await asyncio.to_thread(engine.process_memory)
        own1 = engine.pss_kib(os.getpid())[0]
    finally:
        await rt.close()
    kids = sum(v["pss_kib"] for v in after.values()) - sum(v["pss_kib"] for v in before.values())
    return {"sessions": sessions, "children_pss_mib_per_session": kids / 1024 / sessions,
            "host_pss_growth_mib_per_session": (own1 - own0) / 1024 / sessions,
            "pss_mib_per_session": (kids + own1 - own0) / 1024 / sessions,
            "processes": {k: v["count"] - before.get(k, {}).get("count", 0)
                          for k, v in after.items()}}


# -- main --------------------------------------------------------------------------------------
def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    sizes = SIZES[mode]
    full = mode == "full"
    first = args.wait_idle if args.wait_idle is not None else (900.0 if full else 0.0)
    between = (args.wait_between if args.wait_between is not None else (180.0 if full else 0.0),
               args.max_busy)
    rep: dict[str, Any] = {"machine": machine(), "sections": [],
                           "wait": {"max_load": args.max_load, "max_busy": args.max_busy,
                                    "between_sections_s": between[0],
                                    **wait_quiet(first, args.max_busy, args.max_load)}}
    started = datetime.datetime.now(datetime.timezone.utc)
    rep["run"] = {"mode": mode, "date": started.strftime("%Y-%m-%d %H:%M UTC"),
                  "command": shlex.join([".venv/bin/python", "benchmarks/run_all.py", *argv]),
                  "skipped": sorted(args.skip), "sizes": asdict(sizes),
                  "subreaper": become_subreaper()}
    t0 = perf()
    with LoadSampler() as sampler, tempfile.TemporaryDirectory(prefix="run_all-") as tmp:
        for name, timeout in (("engine", 1200), ("modal_rpc", 900)):
            if name not in args.skip:
                with section(name, rep, between):
                    rep[name] = run_script(name, getattr(sizes, name), Path(tmp), timeout)
        if "agents_sdk" not in args.skip:
            with section("agents_sdk", rep, between):
                rep["agents_sdk"] = run_agents_sdk(mode, Path(tmp))
        if "latency" not in args.skip:
            with section("latency", rep, between), modal_server() as server:
                rep["latency"] = asyncio.run(latency(sizes, server))
        if "slots" not in args.skip:
            with section("throughput vs slots", rep, between):
                rep["throughput_vs_slots"] = throughput_vs_slots(sizes)
        if "sps" not in args.skip:
            with section("throughput vs slots_per_sandbox", rep, between):
                rep["throughput_vs_sps"] = throughput_vs_sps(sizes)
        if "peer_memory" not in args.skip:
            with section("SWE-ReX session memory", rep, between):
                rep["peer_memory"] = asyncio.run(swerex_memory(sizes.swerex_sessions))
        if "load" not in args.skip:
            with section("load", rep, between):
                rep["load"] = run_script("load", sizes.load, Path(tmp), 3600)
        rep["load_during_run"] = sampler.summary()
    import modal_rpc
    rep["processes_left"] = modal_rpc.live_processes()
    rep["run"]["wall_s"] = perf() - t0
    rep["run"]["mem_available_gib_at_end"] = meminfo()["MemAvailable"] / 1024 / 1024
    return rep


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="everything small (~3 min)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for the tests (~30 s)")
    ap.add_argument("--skip", default="", type=lambda s: {x for x in s.split(",") if x},
                    help=f"comma-separated sections to leave out: {', '.join(SCRIPTS + OWN)}")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory "
                    "(default benchmarks/results; the README goes to benchmarks/README.md "
                    "only for the default)")
    ap.add_argument("--wait-idle", type=float, default=None, metavar="S",
                    help="first wait up to S s for a quiet machine: the load average below "
                         "--max-load and fewer than --max-busy cores busy (default 900 for a "
                         "full run, else 0)")
    ap.add_argument("--wait-between", type=float, default=None, metavar="S",
                    help="before each section wait up to S s for fewer than --max-busy cores "
                         "busy (default 180 for a full run, else 0)")
    ap.add_argument("--max-load", type=float, default=4.0, help="see --wait-idle (default 4)")
    ap.add_argument("--max-busy", type=float, default=0.5,
                    help="see --wait-idle (default 0.5 cores)")
    args = ap.parse_args(argv)
    unknown = args.skip - set(SCRIPTS + OWN)
    if unknown:
        ap.error(f"unknown sections in --skip: {', '.join(sorted(unknown))}")
    threading.current_thread().name = "run_all"
    signal.signal(signal.SIGTERM, _interrupt)  # stop every backend on the way out
    rep = compact(run(args, argv))
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(rep, indent=1, allow_nan=False) + "\n"
    (out / "report.json").write_text(text)
    rep = json.loads(text)  # the README is made from exactly what the file holds
    for plot in (plot_latency, plot_slots, plot_sps, plot_memory, plot_rpcs):
        name = plot(rep, out)
        log(f"wrote {out / name}" if name else f"{plot.__name__}: nothing to plot")
    readme = HERE / "README.md" if out == DEFAULT_OUT.resolve() else out / "README.md"
    readme.write_text(render_readme(rep, "results/" if readme.parent != out else ""))
    log(f"wrote {out / 'report.json'} and {readme}")
    print("\n".join(md_table(headline(rep))))
    print("\n---- table for the top-level README (from report.json) ----")
    print(render_top_table(rep))
    print("---- end of the table for the top-level README ----")
    print(f"total wall time: {rep['run']['wall_s']:.0f} s")
    return 0 if not rep.get("errors") and not rep["processes_left"] else 1


if __name__ == "__main__":
    sys.exit(main())
