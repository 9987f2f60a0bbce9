"""The peers the engine benchmark compares with: SWE-ReX's LocalRuntime sessions and
``subprocess.run`` / asyncio subprocesses, measured the same way as our engine."""

from __future__ import annotations

import asyncio
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from _engine_render import summary_ms

perf = time.perf_counter


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
    await rt.create_session(Create(session="bench", startup_timeout=30.0))
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
        loop.run_until_complete(rt.create_session(Create(session=f"s{i}", startup_timeout=30.0)))
        loop.run_until_complete(rt.run_in_session(BashAction(command="true", session=f"s{i}")))
        return loop, rt

    def run(i: int, lr: tuple[asyncio.AbstractEventLoop, Any]) -> tuple[int, str | None]:
        loop, rt = lr
        ok, err = 0, None
        for k in range(cmds):
            try:
                obs = loop.run_until_complete(rt.run_in_session(
                    BashAction(command=f"echo {k}", session=f"s{i}", check="silent")))
            except Exception as exc:  # SWE-ReX gives up after 1 s waiting for an exit code
                err = f"{type(exc).__name__}: {exc}"[:200]
                continue
            ok += obs.output.strip() == str(k)
        return ok, err

    def close(lr: tuple[asyncio.AbstractEventLoop, Any]) -> None:
        loop, rt = lr
        try:
            loop.run_until_complete(rt.close())
        finally:
            loop.close()

    with ThreadPoolExecutor(sessions) as ex:
        t0 = perf()
        futs = [ex.submit(create, i) for i in range(sessions)]
        lrs, errors = [], []
        for f in futs:
            try:
                lrs.append(f.result())
            except Exception as exc:
                errors.append(exc)
        created = perf() - t0
        try:
            if errors:
                raise errors[0]
            t0 = perf()
            outs = [f.result() for f in [ex.submit(run, i, lr) for i, lr in enumerate(lrs)]]
            dt = perf() - t0
        finally:
            for f in [ex.submit(close, lr) for lr in lrs]:
                f.exception()
    total = sessions * cmds
    errors = [e for _, e in outs if e]
    return {"sessions": sessions, "calls": total, "ok": sum(o for o, _ in outs), "seconds": dt,
            "calls_per_s": total / dt, "create_all_s": created, "errors": errors[:3]}


async def throughput_swerex_gather(sessions: int, cmds: int) -> dict[str, Any]:
    """asyncio.gather over sessions in one loop (how an async caller would try it)."""
    LocalRuntime, Create, BashAction, Close = _swerex_imports()
    rt = LocalRuntime()
    for i in range(sessions):
        await rt.create_session(Create(session=f"g{i}", startup_timeout=30.0))
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
