"""The latency section of ``run_all.py``: the raw time of ``echo hi`` calls, interleaved in
blocks across every system (ours on the local and the Modal driver, the original's and
``langchain-modal``'s exec per command, a SWE-ReX session, ``subprocess.run``), stored as
quantiles and a log-spaced histogram, with the RPCs per command of the Modal ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

from _peers import _swerex_imports
from _proc import quantile
from _report import HIST_LO_S, HIST_PER_DECADE, SYSTEMS
from _run_all_setup import COMMAND, PROFILE, Sizes, backend

from hermes_modal_tool import ModalSandboxConfig, SandboxConfig, ToolBackend

perf = time.perf_counter
#: The quantiles stored of every system's latencies.
QS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0)


def distribution(xs: Sequence[float]) -> dict[str, Any]:
    """Quantiles (ms) and a sparse log-spaced histogram (bin index -> count) of seconds."""
    hist: dict[str, int] = {}
    for x in xs:
        i = max(0, math.floor(math.log10(max(x, HIST_LO_S) / HIST_LO_S) * HIST_PER_DECADE))
        hist[str(i)] = hist.get(str(i), 0) + 1
    return {"n": len(xs), "ms": {f"p{q * 100:g}": quantile(xs, q) * 1e3 for q in QS},
            "mean_ms": sum(xs) / len(xs) * 1e3 if xs else math.nan,
            "hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0])))}


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
        LocalRuntime, Create, BashAction, _ = _swerex_imports()
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
