"""Section c of ``modal_rpc.py``, where our time per command goes: timestamps at each hop
of a warm command (``breakdown``, its legs in ``LEGS``), our driver's transport without the
agent and bash (``transport_floor``: echo round trips through ``cat`` execs, read three
ways, ``FLOORS``) and the same command on the local driver (``local_driver``).
``_modal_rpc_render.py`` prints the legs and floors by these keys.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from _modal_rpc_base import COMMAND, PROFILE, SLOTS, summary_ms
from modal._utils.async_utils import synchronize_api

from hermes_modal_tool import SandboxConfig, ToolBackend
from hermes_modal_tool.drivers import _modal_sdk
from hermes_modal_tool.testing.modal_server import LocalModalServer

perf = time.perf_counter


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
