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

Section c is in ``_modal_rpc_hops.py``, the tables in ``_modal_rpc_render.py``, and what
the parts share (the profile, the command, ``Meter``, ``step``) in ``_modal_rpc_base.py``.

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
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import modal
from rich.console import Console

from hermes_modal_tool import ModalToolBackend, ToolBackend
from hermes_modal_tool.testing.modal_server import LocalModalServer, serve_for_this_process

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared benchmark helpers
from _modal_rpc_base import (  # noqa: E402
    COMMAND,
    CPU_LOG,
    PROFILE,
    SLOTS,
    Meter,
    cfg,
    per,
    settle,
    step,
    summary_ms,
)
from _modal_rpc_hops import breakdown, local_driver, transport_floor  # noqa: E402 - section c
from _modal_rpc_render import render  # noqa: E402
from _proc import become_subreaper, descendants, proc_stats, quantile  # noqa: E402
from _rounds import echo_rounds  # noqa: E402

perf = time.perf_counter


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
            wall, bad = await echo_rounds(b, slots, rounds)
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


# -- main -------------------------------------------------------------------------------------
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
