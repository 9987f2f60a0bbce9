"""Modal RPC benchmark: what one command costs through our Modal driver vs the original's
``sandbox.exec`` per command, in RPCs and in time.

Everything runs against the package's local Modal control plane
(``hermes_modal_tool.testing.modal_server``), started by this script on its own thread; the
real ``modal`` SDK talks gRPC to it, and it counts every RPC it serves by method
(``rpc_counts``) and every request message on streaming RPCs (``stream_messages``).
Measured in one run:

a. starting: ``ToolBackend.start()`` to ready (a new client, app, image, one sandbox and
   its agent exec), the first one in this process and later ones; an extra sandbox started
   by pool growth; ``stop()``. RPCs by method and wall time.
b. ours, warm: ``--commands`` sequential ``execute_batch`` calls of ``echo hi`` on one slot
   (median / p90 / p99 ms) and a throughput run (one batch over all 8 slots of a sandbox,
   ``--rounds`` times): RPCs and stream messages per command (our driver carries commands on
   one open stdin stream and one stdout stream, so it must be 0 RPCs);
c. where our time goes: timestamps at each hop of a command (host engine, the SDK's loop,
   the server, the agent and back); for reference the same command on the local driver, an
   echo round trip through a ``cat`` exec with stdout read three ways (``.aio`` iteration
   from our loop, as the driver reads; pumped on the SDK's loop and handed over with
   ``call_soon_threadsafe``; timed entirely on the SDK's loop), and one ``.aio`` call of a
   no-op (the SDK's cross-thread hop there and back);
d. the original: ``Sandbox.create`` with the SDK's ``.aio`` API, then per command
   ``sandbox.exec("bash", "-c", cmd)``, read stdout, read stderr, ``wait()``: RPCs by
   method and latency for the same command and count, and the same throughput run with
   8 concurrent execs per round.

Usage::

    .venv/bin/python benchmarks/modal_rpc.py                  # full run (20-60 s on 2 cores)
    .venv/bin/python benchmarks/modal_rpc.py --quick          # small run (5-20 s)
    .venv/bin/python benchmarks/modal_rpc.py --commands 500 --json /tmp/modal_rpc.json

The local server runs in this process (a thread of its own) and its sandboxes on this
machine, so latencies here have no network in them (and the server shares this process's
GIL); the RPC counts are what the SDK sends, so Modal would serve the same. The original's
sequential commands stop at a time budget (``--budget``): on a loaded machine each exec can
take hundreds of ms. The CPU used by other processes during each step is printed, since
anything else running on the machine skews the times. Exit status 1 means our driver made
an RPC during warm commands, or something (a sandbox, an exec, a process) was left running
after stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import modal
from modal._utils.async_utils import synchronize_api
from rich.console import Console
from rich.table import Table

from hermes_modal_tool import ModalSandboxConfig, ModalToolBackend, SandboxConfig, ToolBackend
from hermes_modal_tool.drivers import _modal_sdk
from hermes_modal_tool.testing.modal_server import LocalModalServer, serve_for_this_process

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared benchmark helpers
from _proc import CpuStep, become_subreaper, descendants, proc_stats, quantile  # noqa: E402

perf = time.perf_counter
PROFILE = f"mrpc{os.getpid()}"  # unique to this run: sandbox ids and cgroup names derive from it
COMMAND = "echo hi"
SLOTS = 8
CPU_LOG: list[dict[str, Any]] = []


# -- small helpers -----------------------------------------------------------------------
def summary_ms(xs: Sequence[float]) -> dict[str, float]:
    """Seconds in, a dict of milliseconds out."""
    return {"n": len(xs), "median": quantile(xs, 0.5) * 1e3, "p90": quantile(xs, 0.9) * 1e3,
            "p99": quantile(xs, 0.99) * 1e3, "mean": sum(xs) / max(len(xs), 1) * 1e3}


def fmt_ms(v: float) -> str:
    if v != v:
        return "n/a"
    if v < 1:
        return f"{v * 1000:.0f} µs"
    return f"{v:.2f} ms" if v < 100 else f"{v:.0f} ms"


def fmt_lat(s: dict[str, float]) -> str:
    return f"{fmt_ms(s['median'])} / {fmt_ms(s['p90'])} / {fmt_ms(s['p99'])}"


def per(counts: dict[str, int], n: int) -> dict[str, float]:
    return {k: v / n for k, v in sorted(counts.items())}


def fmt_counts(counts: dict[str, float]) -> str:
    if not counts:
        return "none"
    return ", ".join(f"{k} {v:g}" if v == int(v) else f"{k} {v:.2f}" for k, v in counts.items())


class Meter:
    """RPCs and stream messages the server received between :meth:`reset` and :meth:`read`."""

    def __init__(self, server: LocalModalServer) -> None:
        self.server = server

    def reset(self) -> None:
        self.server.reset_counts()

    def read(self) -> dict[str, dict[str, int]]:
        return {"rpcs": dict(self.server.rpc_counts),
                "stream_messages": dict(self.server.stream_messages)}


@contextlib.contextmanager
def step(label: str) -> Iterator[CpuStep]:
    """A measured step: its wall time and the CPU busy elsewhere go to the CPU log."""
    print(f"  .. {label}", file=sys.stderr, flush=True)
    with CpuStep(label) as s:
        yield s
    r = s.result()
    CPU_LOG.append(r)
    print(f"  .. {label}: {r['wall_s']:.1f} s (other processes: {r['other_cores_low']:.2f}.."
          f"{r['other_cores']:.2f} cores busy)", file=sys.stderr, flush=True)


def cfg(**kw: Any) -> ModalSandboxConfig:
    base: dict[str, Any] = {"name": PROFILE, "image": "python:3.11", "slots_per_sandbox": SLOTS,
                            "min_sandboxes": 1, "max_sandboxes": 2, "execution_timeout_s": 60,
                            "idle_timeout": 600}
    base.update(kw)
    return ModalSandboxConfig(**base)


async def settle() -> None:
    """Let streams that a start opens in the background reach the server."""
    await asyncio.sleep(0.2)


# -- a. starting --------------------------------------------------------------------------
async def starts(meter: Meter, n: int) -> list[dict[str, Any]]:
    out = []
    for _ in range(n):
        b = ModalToolBackend(cfg())
        meter.reset()
        t0 = perf()
        try:
            await b.start()
            wall = perf() - t0
            await settle()
            counts = meter.read()
        finally:
            meter.reset()
            t0 = perf()
            await b.stop()
            stop_wall = perf() - t0
            stop_counts = meter.read()
        out.append({"start_s": wall, **counts, "stop_s": stop_wall, "stop": stop_counts})
    return out


# -- b. ours, warm ------------------------------------------------------------------------
def the_handle(b: ToolBackend) -> Any:
    """The ModalHandle of the (first) sandbox of the benchmark's pool."""
    pool = b._pools[PROFILE]
    return next(iter(pool._sandboxes.values())).handle


async def ours(server: LocalModalServer, meter: Meter, n: int, rounds: int,
               breakdown_n: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    b = ModalToolBackend(cfg())
    try:
        with step("b. ours: start"):
            await b.start()
        meter.reset()
        slots = [await b.acquire(f"traj-{i}") for i in range(SLOTS)]
        res["acquire_8"] = meter.read()
        handle = the_handle(b)
        slot = slots[0]
        req = [(slot, "bash", {"command": COMMAND})]
        for _ in range(20):
            [r] = await b.execute_batch(req)
        with step(f"b. ours: {n} sequential commands"):
            sent0 = handle._pipe.sent
            meter.reset()
            xs, agent = [], []
            bad = 0
            for _ in range(n):
                t0 = perf()
                [r] = await b.execute_batch(req)
                xs.append(perf() - t0)
                agent.append(r.metadata.get("duration_s") or 0.0)
                bad += r.output != "hi\n"
            counts = meter.read()
        res["latency"] = {**summary_ms(xs), "agent_side_median_ms": quantile(agent, 0.5) * 1e3,
                          "wrong_outputs": bad, **counts,
                          "rpcs_per_command": per(counts["rpcs"], n),
                          "stream_messages_per_command": per(counts["stream_messages"], n),
                          "stdin_bytes_per_command": (handle._pipe.sent - sent0) / n}
        await b.execute_batch([(s, "bash", {"command": "true"}) for s in slots])  # warm every shell
        with step(f"b. ours: {SLOTS} slots x {rounds} rounds"):
            meter.reset()
            bad = 0
            t0 = perf()
            for i in range(rounds):
                rs = await b.execute_batch([(s, "bash", {"command": f"echo {i}"}) for s in slots])
                bad += sum(x.output != f"{i}\n" for x in rs)
            wall = perf() - t0
            counts = meter.read()
        calls = SLOTS * rounds
        res["throughput"] = {"slots": SLOTS, "rounds": rounds, "calls": calls, "seconds": wall,
                             "calls_per_s": calls / wall, "round_ms": wall / rounds * 1e3,
                             "wrong_outputs": bad, **counts,
                             "rpcs_per_command": per(counts["rpcs"], calls),
                             "stream_messages_per_command": per(counts["stream_messages"], calls)}
        with step(f"c. where the time goes ({breakdown_n} commands)"):
            res["breakdown"] = await breakdown(server, b, slot, handle, breakdown_n)
        with step("a. ours: an extra sandbox (pool growth)"):
            meter.reset()
            t0 = perf()
            extra = await b.acquire("traj-extra")  # all 8 slots are held: a second sandbox starts
            wall = perf() - t0
            await settle()
            res["growth"] = {"acquire_s": wall, **meter.read(),
                             "sandboxes": b.get_status()["pools"][PROFILE]["sandboxes"]}
        meter.reset()
        for s in [*slots, extra]:
            await b.release(s, reset_workspace=True)
        res["release_9_with_reset"] = meter.read()
        res["status"] = {k: v for k, v in b.get_status()["pools"][PROFILE].items()
                         if k in ("sandboxes", "calls", "failures", "isolation", "limits")}
    finally:
        meter.reset()
        t0 = perf()
        await b.stop()
        live = b.get_status()["drivers"]["modal"]["live_sandboxes"]
        res["stop"] = {"stop_s": perf() - t0, **meter.read(), "driver_live_sandboxes": live}
    res["left_running"] = await left_running(server, lambda r: r.tags.get("hmt-profile") == PROFILE)
    return res


# -- c. where the time goes ------------------------------------------------------------------
async def breakdown(server: LocalModalServer, b: ToolBackend, slot: Any, handle: Any,
                    n: int) -> dict[str, Any]:
    """Timestamps (one clock: this process) at each hop of a warm command.

    Hooks are instance attributes over the driver's handle and pipe and the server's record
    of the agent exec, removed afterwards; each adds about a microsecond.
    """
    proc = next(p for p in server._state_of[handle.modal_id].execs.values() if p.argv[0] == "sh")
    marks: dict[str, float] = {}

    def marking(key: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        def hook(*args: Any) -> Any:
            marks.setdefault(key, perf())  # the first time per command
            return orig(*args)  # (write_stdin's coroutine is marked when it is made)
        return hook

    hooks = [(handle, "write", "write"), (handle._pipe, "_remember", "sdk_stdin"),
             (proc, "write_stdin", "server_stdin"), (proc.stdout, "append", "server_stdout"),
             (handle, "_on_data", "host_stdout")]
    saved = [(obj, name, vars(obj).get(name)) for obj, name, _ in hooks]
    for obj, name, key in hooks:
        setattr(obj, name, marking(key, getattr(obj, name)))
    legs: dict[str, list[float]] = {k: [] for k in LEGS}
    agent: list[float] = []
    try:
        req = [(slot, "bash", {"command": COMMAND})]
        for _ in range(n):
            marks.clear()
            t0 = perf()
            [r] = await b.execute_batch(req)
            t_end = perf()
            m = {"start": t0, **marks, "end": t_end}
            if len(m) != len(LEGS) + 1:
                continue  # a hook did not fire (should not happen)
            for (key, (a, z)) in LEGS.items():
                legs[key].append(m[z] - m[a])
            agent.append(r.metadata.get("duration_s") or 0.0)
    finally:
        for obj, name, own in saved:  # an instance attribute before (handle._on_data) or none
            if own is None:
                delattr(obj, name)
            else:
                setattr(obj, name, own)
    out = {key: summary_ms(xs) for key, xs in legs.items()}
    out["agent_side"] = summary_ms(agent)
    out["total"] = summary_ms([sum(x) for x in zip(*legs.values(), strict=True)])
    return out


#: leg -> (from mark, to mark); the marks are taken on the host loop (start, write,
#: host_stdout, end), the SDK's loop (sdk_stdin) and the server's loop (server_*).
LEGS = {
    "host engine: execute_batch -> handle.write": ("start", "write"),
    "stdin: hop to the SDK's loop": ("write", "sdk_stdin"),
    "stdin: gRPC stream -> server": ("sdk_stdin", "server_stdin"),
    "server -> agent + bash -> server": ("server_stdin", "server_stdout"),
    "stdout: server -> gRPC -> SDK -> .aio -> host": ("server_stdout", "host_stdout"),
    "host engine: result -> execute_batch returns": ("host_stdout", "end"),
}


async def _rounds_on_sdk_loop(process: Any, pipe: _modal_sdk.StdinPipe, n: int) -> list[float]:
    """``n`` echo round trips through ``cat``, timed and read on the SDK's own loop (after
    one untimed round that opens the stream)."""
    it = process.stdout.__aiter__()
    xs = []
    try:
        for i in range(n + 1):
            t0 = perf()
            pipe.write(b"x\n")
            await it.__anext__()
            if i:
                xs.append(perf() - t0)
    finally:
        await it.aclose()
    return xs


async def _pump_on_sdk_loop(process: Any, loop: asyncio.AbstractEventLoop,
                            queue: asyncio.Queue) -> None:
    """Read ``process``'s stdout on the SDK's loop; hand each chunk to ``loop`` (one hop)."""
    async for chunk in process.stdout:
        loop.call_soon_threadsafe(queue.put_nowait, chunk)
    loop.call_soon_threadsafe(queue.put_nowait, b"")


async def _noop() -> None:
    return None


rounds_on_sdk_loop = synchronize_api(_rounds_on_sdk_loop, target_module=__name__)
pump_on_sdk_loop = synchronize_api(_pump_on_sdk_loop, target_module=__name__)
noop = synchronize_api(_noop, target_module=__name__)
FLOORS = {
    "aio": "ref: `cat` echo via the SDK, stdout read by .aio iteration (as the driver)",
    "pump": "ref: the same, stdout pumped on the SDK's loop + call_soon_threadsafe",
    "sdk_loop": "ref: the same, all on the SDK's loop (no thread hop)",
}


async def transport_floor(sb: Any, n: int, block: int = 25) -> dict[str, Any]:
    """Echo round trips through long-lived ``cat`` execs: our driver's transport without the
    agent and bash, three ways (see :data:`FLOORS`). Blocks of each alternate, so a change
    in the machine's load hits all alike."""
    loop = asyncio.get_running_loop()
    procs, pipes, feeders = [], [], []
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    try:
        for _ in FLOORS:
            procs.append(await sb.exec.aio("cat", text=False))
            pipes.append(_modal_sdk.StdinPipe())
            feeders.append(asyncio.ensure_future(_modal_sdk.run_stdin_stream.aio(procs[-1],
                                                                                 pipes[-1])))
        it = procs[0].stdout.__aiter__()
        feeders.append(asyncio.ensure_future(pump_on_sdk_loop.aio(procs[1], loop, queue)))
        times: dict[str, list[float]] = {k: [] for k in FLOORS}
        for i in range(-1, n, block):  # i == -1: an untimed warm-up block
            k = min(block, n - max(i, 0))
            xs, ys = [], []
            for _ in range(k):
                t0 = perf()
                pipes[0].write(b"x\n")
                await it.__anext__()
                xs.append(perf() - t0)
            for _ in range(k):
                t0 = perf()
                pipes[1].write(b"x\n")
                await queue.get()
                ys.append(perf() - t0)
            zs = await rounds_on_sdk_loop.aio(procs[2], pipes[2], k)
            if i >= 0:
                for key, got in zip(FLOORS, (xs, ys, zs), strict=True):
                    times[key] += got
        await it.aclose()
    finally:
        for pipe in pipes:
            pipe.close()
        await asyncio.wait_for(asyncio.gather(*feeders, return_exceptions=True), 10)
        for process in procs:
            await process.wait.aio()
    out = {key: summary_ms(xs) for key, xs in times.items()}
    for _ in range(50):
        await noop.aio()
    zs = []
    for _ in range(n):
        t0 = perf()
        await noop.aio()
        zs.append(perf() - t0)
    out["aio_noop_call"] = summary_ms(zs)
    return out


async def local_driver(n: int) -> dict[str, Any]:
    """The same command on the local (bubblewrap) driver: the engine without Modal."""
    b = ToolBackend(SandboxConfig(name=f"{PROFILE}l", driver="local", slots_per_sandbox=SLOTS,
                                  min_sandboxes=1, max_sandboxes=1))
    try:
        await b.start()
        slot = await b.acquire("local")
        req = [(slot, "bash", {"command": COMMAND})]
        for _ in range(20):
            await b.execute_batch(req)
        xs = []
        for _ in range(n):
            t0 = perf()
            [r] = await b.execute_batch(req)
            xs.append(perf() - t0)
        assert r.output == "hi\n", r
    finally:
        await b.stop()
    return summary_ms(xs)


# -- d. the original ------------------------------------------------------------------------
async def exec_once(sb: Any, cmd: str) -> tuple[str, str, int]:
    """The original backend's way: one exec per command, read both streams, wait."""
    p = await sb.exec.aio("bash", "-c", cmd)
    out = await p.stdout.read.aio()
    err = await p.stderr.read.aio()
    return out, err, await p.wait.aio()


async def original(server: LocalModalServer, meter: Meter, n: int, rounds: int,
                   floor_n: int, budget_s: float) -> dict[str, Any]:
    res: dict[str, Any] = {}
    LocalModalServer.reset_env_client()  # the original used the SDK's env client
    app = await modal.App.lookup.aio(f"{PROFILE}-original", create_if_missing=True)
    meter.reset()
    t0 = perf()
    sb = await modal.Sandbox.create.aio(app=app, image=modal.Image.from_registry("python:3.11"))
    res["create"] = {"create_s": perf() - t0, **meter.read()}
    try:
        for _ in range(3):
            await exec_once(sb, COMMAND)
        with step(f"d. original: {n} sequential commands"):
            meter.reset()
            xs, bad = [], 0
            deadline = perf() + budget_s  # a loaded machine makes each exec slow
            while len(xs) < n and perf() < deadline:
                t0 = perf()
                out, _err, code = await exec_once(sb, COMMAND)
                xs.append(perf() - t0)
                bad += (out, code) != ("hi\n", 0)
            counts = meter.read()
        done = len(xs)
        res["latency"] = {**summary_ms(xs), "wanted": n, "budget_s": budget_s, "wrong_outputs": bad,
                          **counts, "rpcs_per_command": per(counts["rpcs"], done),
                          "stream_messages_per_command": per(counts["stream_messages"], done)}
        with step(f"d. original: {SLOTS} concurrent execs x {rounds} rounds"):
            meter.reset()
            bad = 0
            t0 = perf()
            for i in range(rounds):
                rs = await asyncio.gather(*(exec_once(sb, f"echo {i}") for _ in range(SLOTS)))
                bad += sum(out != f"{i}\n" for out, _, _ in rs)
            wall = perf() - t0
            counts = meter.read()
        calls = SLOTS * rounds
        res["throughput"] = {"concurrent": SLOTS, "rounds": rounds, "calls": calls,
                             "seconds": wall, "calls_per_s": calls / wall,
                             "round_ms": wall / rounds * 1e3, "wrong_outputs": bad, **counts,
                             "rpcs_per_command": per(counts["rpcs"], calls)}
        with step(f"c. transport floor: 3 x {floor_n} cat round trips"):
            res["transport_floor"] = await transport_floor(sb, floor_n)
    finally:
        meter.reset()
        t0 = perf()
        await sb.terminate.aio()
        res["terminate"] = {"terminate_s": perf() - t0, **meter.read()}
    res["left_running"] = await left_running(server, lambda r: r.app_name == f"{PROFILE}-original")
    return res


# -- what was left behind -----------------------------------------------------------------------
async def left_running(server: LocalModalServer, mine: Callable[[Any], bool],
                       timeout: float = 10.0) -> list[str]:
    """Sandboxes (matching ``mine``) still running or with live execs on the server."""
    deadline = time.monotonic() + timeout
    while True:
        left = [f"{r.sandbox_id} ({r.status}, {r.live_execs} live execs)"
                for r in list(server.sandboxes.values())
                if mine(r) and (r.status != "finished" or r.live_execs)]
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.05)


def live_processes(timeout: float = 10.0) -> list[str]:
    """Live descendants of this process (sandbox processes the server or a driver started).

    This process is a child subreaper: processes orphaned inside a sandbox come back here.
    Zombies among our children that nothing waits for are reaped.
    """
    deadline = time.monotonic() + timeout
    while True:
        live = []
        for pid in descendants(os.getpid(), live_only=True):
            try:
                with open(f"/proc/{pid}/cmdline") as fh:
                    live.append(f"{pid}: {fh.read().replace(chr(0), ' ')[:80]}")
            except OSError:
                continue
        if not live or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid, f in proc_stats():
        if f[0] == "Z" and int(f[1]) == os.getpid():
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
    return live


# -- the run ------------------------------------------------------------------------------------
async def run_all(server: LocalModalServer, args: argparse.Namespace) -> dict[str, Any]:
    meter = Meter(server)
    res: dict[str, Any] = {}
    with step(f"a. starting: {args.starts} backends"):
        res["starts"] = await starts(meter, args.starts)
    res["ours"] = await ours(server, meter, args.commands, args.rounds, args.commands)
    res["original"] = await original(server, meter, args.commands, args.rounds, args.commands,
                                     args.budget)
    with step(f"c. local driver: {args.commands} commands"):
        try:
            res["local_driver"] = await local_driver(args.commands)
        except Exception as exc:  # optional reference: needs bubblewrap here
            res["local_driver"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return res


def machine() -> dict[str, Any]:
    from importlib.metadata import version

    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh
                          if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"nproc": len(os.sched_getaffinity(0)), "cpu": model, "python": sys.version.split()[0],
            "modal": version("modal"), "loadavg_1m": os.getloadavg()[0]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"machine": machine(), "quick": args.quick,
                           "subreaper": become_subreaper(), "command": COMMAND}
    t0 = perf()
    with serve_for_this_process() as server:
        res["server"] = {"isolation": server.isolation, "url": server.url}
        res.update(asyncio.run(run_all(server, args)))
        res["server"]["sandboxes"] = len(server.sandboxes)
        res["server"]["api_versions"] = sorted({r.api_version for r in server.sandboxes.values()})
    res["processes_left"] = live_processes()
    res["wall_s"] = perf() - t0
    res["cpu_log"] = CPU_LOG
    ours_rpcs = (sum(res["ours"]["latency"]["rpcs"].values())
                 + sum(res["ours"]["throughput"]["rpcs"].values()))
    res["checks"] = {
        "ours_rpcs_during_warm_commands": ours_rpcs,
        "ours_left_running": res["ours"]["left_running"],
        "original_left_running": res["original"]["left_running"],
        "processes_left": res["processes_left"],
        "wrong_outputs": sum(res[k][s]["wrong_outputs"] for k in ("ours", "original")
                             for s in ("latency", "throughput")),
    }
    res["checks"]["ok"] = (ours_rpcs == 0 and not res["ours"]["left_running"]
                           and not res["original"]["left_running"] and not res["processes_left"]
                           and res["ours"]["stop"]["driver_live_sandboxes"] == 0
                           and res["checks"]["wrong_outputs"] == 0)
    return res


# -- the report -------------------------------------------------------------------------------
def render(res: dict[str, Any], console: Console) -> None:
    m, o, g = res["machine"], res["ours"], res["original"]
    n = o["latency"]["n"]
    console.print(f"[bold]Modal RPC benchmark[/bold]: local Modal control plane "
                  f"(isolation {res['server']['isolation']}, sandbox API "
                  f"V{'/'.join(map(str, res['server']['api_versions']))}), modal {m['modal']}, "
                  f"Python {m['python']}, {m['nproc']} cores ({m['cpu']}), load average "
                  f"{m['loadavg_1m']:.1f} at the start{', QUICK run' if res['quick'] else ''}")

    t = Table(title=f"Per warm command: `{res['command']}`, {n} sequential calls on one slot; "
                    f"throughput: {SLOTS} slots x {o['throughput']['rounds']} rounds",
              title_justify="left")
    t.add_column("")
    t.add_column("ours: one long-lived exec, stdio streams", overflow="fold")
    t.add_column("original: sandbox.exec per command", overflow="fold")
    ol, gl = o["latency"], g["latency"]
    t.add_row("RPCs per command", f"{sum(ol['rpcs_per_command'].values()):g}",
              f"{sum(gl['rpcs_per_command'].values()):g}")
    t.add_row("  by method", fmt_counts(ol["rpcs_per_command"]), fmt_counts(gl["rpcs_per_command"]))
    t.add_row("stream request messages per command", fmt_counts(ol["stream_messages_per_command"]),
              fmt_counts(gl["stream_messages_per_command"]))
    cut = f" (n = {gl['n']}: time budget {gl['budget_s']:g} s)" if gl["n"] < gl["wanted"] else ""
    t.add_row("latency median / p90 / p99", fmt_lat(ol), fmt_lat(gl) + cut)
    t.add_row("  agent-side run time, median", fmt_ms(ol["agent_side_median_ms"]), "")
    ot, gt = o["throughput"], g["throughput"]
    t.add_row(f"throughput ({ot['calls']} calls)",
              f"{ot['calls_per_s']:,.0f} calls/s ({fmt_ms(ot['round_ms'])} per batch of {SLOTS}); "
              f"{sum(ot['rpcs'].values())} RPCs",
              f"{gt['calls_per_s']:,.0f} calls/s ({SLOTS} concurrent execs, "
              f"{fmt_ms(gt['round_ms'])} per round); "
              f"{sum(gt['rpcs_per_command'].values()):g} RPCs per call")
    t.add_row("stdin bytes per command", f"{ol['stdin_bytes_per_command']:.0f}", "")
    console.print(t)

    t = Table(title="One-time costs", title_justify="left")
    t.add_column("")
    t.add_column("wall")
    t.add_column("RPCs")
    t.add_column("by method (stream request messages)", overflow="fold")

    def row(label: str, wall: float, counts: dict[str, Any]) -> None:
        sm = counts.get("stream_messages") or {}
        extra = f" ({fmt_counts(sm)})" if sm else ""
        t.add_row(label, fmt_ms(wall * 1e3), str(sum(counts["rpcs"].values())),
                  fmt_counts(counts["rpcs"]) + extra)

    st = res["starts"]
    row("ours: start() to ready, first in this process", st[0]["start_s"], st[0])
    if len(st) > 1:
        later = sorted(st[1:], key=lambda x: x["start_s"])[(len(st) - 2) // 2]
        row(f"ours: start() to ready, later (median of {len(st) - 1})", later["start_s"], later)
    row("ours: an extra sandbox (acquire -> pool growth)", o["growth"]["acquire_s"], o["growth"])
    row(f"ours: stop() ({o['growth']['sandboxes']} sandboxes)", o["stop"]["stop_s"], o["stop"])
    row("original: Sandbox.create", g["create"]["create_s"], g["create"])
    row("original: sandbox.terminate", g["terminate"]["terminate_s"], g["terminate"])
    t.add_row("ours: acquire 8 slots / release 9 with reset", "",
              f"{sum(o['acquire_8']['rpcs'].values())} / "
              f"{sum(o['release_9_with_reset']['rpcs'].values())}", "")
    console.print(t)

    bd = o["breakdown"]
    t = Table(title=f"Where our time per command goes ({bd['total']['n']} commands; "
                    "the legs' medians need not add up)", title_justify="left")
    t.add_column("")
    t.add_column("median")
    t.add_column("p90")
    for key in LEGS:
        t.add_row(key, fmt_ms(bd[key]["median"]), fmt_ms(bd[key]["p90"]))
    t.add_row("  of which the agent's own run time", fmt_ms(bd["agent_side"]["median"]),
              fmt_ms(bd["agent_side"]["p90"]))
    t.add_row("[bold]total[/bold]", fmt_ms(bd["total"]["median"]), fmt_ms(bd["total"]["p90"]))
    lo = res.get("local_driver", {})
    if "median" in lo:
        t.add_row("ref: the same command on the local driver (no Modal)",
                  fmt_ms(lo["median"]), fmt_ms(lo["p90"]))
    else:
        t.add_row("ref: local driver", lo.get("error", "n/a"), "")
    fl = g["transport_floor"]
    for key, label in FLOORS.items():
        t.add_row(label, fmt_ms(fl[key]["median"]), fmt_ms(fl[key]["p90"]))
    t.add_row("ref: one .aio call of a no-op coroutine (two thread hops)",
              fmt_ms(fl["aio_noop_call"]["median"]), fmt_ms(fl["aio_noop_call"]["p90"]))
    console.print(t)

    c = res["checks"]
    ok = "[green]PASS[/green]" if c["ok"] else "[red]FAIL[/red]"
    console.print(f"Checks {ok}: RPCs by our driver during {n + ot['calls']} warm commands: "
                  f"{c['ours_rpcs_during_warm_commands']}; left running after stop: ours "
                  f"{c['ours_left_running'] or 'none'}, original "
                  f"{c['original_left_running'] or 'none'}; "
                  f"live processes left: {c['processes_left'] or 'none'}; wrong outputs: "
                  f"{c['wrong_outputs']}")
    t = Table(title="CPU during each step: a shared machine skews the times", title_justify="left")
    for col in ("step", "wall", "ours (cores)", "other processes (cores, lower..upper bound)"):
        t.add_column(col)
    for x in res["cpu_log"]:
        t.add_row(x["step"], f"{x['wall_s']:.1f} s", f"{x['own_cores']:.2f}",
                  f"{x['other_cores_low']:.2f}..{x['other_cores']:.2f}")
    console.print(t)
    console.print(f"total wall time: {res['wall_s']:.1f} s")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small, fast run (5-20 s)")
    ap.add_argument("--commands", type=int, default=None, metavar="N",
                    help="sequential commands per measurement (default 200; 20 with --quick)")
    ap.add_argument("--rounds", type=int, default=None,
                    help=f"throughput rounds over {SLOTS} slots (default 25; 2 with --quick)")
    ap.add_argument("--starts", type=int, default=None,
                    help="backends started and stopped to measure starting (default 5; 2 with "
                         "--quick)")
    ap.add_argument("--budget", type=float, default=None, metavar="S",
                    help="at most S seconds for the original's sequential commands (default 30; "
                         "10 with --quick): on a loaded machine each exec can take 100s of ms")
    ap.add_argument("--json", metavar="PATH", help="also write every number as JSON")
    args = ap.parse_args(argv)
    args.commands = args.commands or (20 if args.quick else 200)
    args.rounds = args.rounds or (2 if args.quick else 25)
    args.starts = args.starts or (2 if args.quick else 5)
    args.budget = args.budget or (10.0 if args.quick else 30.0)
    res = run(args)
    render(res, Console(width=130, highlight=False))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2, default=str)
    return 0 if res["checks"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
