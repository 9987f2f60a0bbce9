"""The host's CPU per tool call on the grouped batch path, apart from the agents.

On a machine whose cores are shared (by the agents and shells of the run itself, or by
other programs), the host's CPU per call measured beside running agents moves by half
from one run to the next: the agents and shells evict the host's caches and preempt it.
Here the real backend, pool, sandboxes and slots run ``execute_batch`` rounds of
``echo i`` as section s of ``engine.py`` does, but once the slots are warm each sandbox's
agent is bypassed: the bytes the host writes to a sandbox are read by a responder in the
host process, which answers each ``calls`` frame with the ``results`` frame an agent
sends for those commands (``{"output": "i\\n", "returncode": 0, "duration_s": ...}``,
compact, one frame per batch), delivered to the sandbox's reader on the next loop pass.
The responder's own CPU is timed and subtracted. What is left is the host's thread CPU
per call (``time.thread_time``): checking and sorting the requests, queueing and
encoding the calls, decoding the replies, making the ExecutionResults, the event loop's
passes, no pipe reads or writes. Printed per run, and the smallest (the least disturbed).

    .venv/bin/python benchmarks/host_calls.py --sandboxes 8 --slots 128 --seconds 3 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from typing import Any

from _engine_backends import cfg, started

from hermes_modal_tool import protocol

tt = time.thread_time_ns


class Responder:
    """Stands in for a sandbox's handle (``write`` only; the rest from the real one):
    answers each ``calls`` frame written with its ``results`` frame."""

    spent_ns = 0

    def __init__(self, sandbox: Any) -> None:
        self.sandbox, self.real = sandbox, sandbox.handle
        self.decoder = protocol.FrameDecoder()
        self.loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        t0 = tt()
        out = []
        for msg in self.decoder.feed(data):
            if msg.get("op") == "calls":
                out.append(protocol.encode({"id": 0, "results": [
                    [c[0], {"output": c[3]["command"][5:] + "\n", "returncode": 0, "duration_s": 0.00123}]
                    for c in msg["calls"]]}))
        if out:
            self.loop.call_soon(self.sandbox._on_data, b"".join(out))
        Responder.spent_ns += tt() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


async def measure(sandboxes: int, slots: int, seconds: float, runs: int) -> list[dict[str, float]]:
    b = await started(cfg(slots_per_sandbox=-(-slots // sandboxes), min_sandboxes=sandboxes,
                          max_sandboxes=sandboxes, scale_down_idle=False))
    rows = []
    try:
        use = [await b.acquire(f"hc-{i}") for i in range(slots)]
        await b.execute_batch([(s, "bash", {"command": "true"}) for s in use])  # every shell started
        boxes = {s._sandbox.sandbox for s in use}
        for sb in boxes:
            sb.handle = Responder(sb)
        try:
            for i in range(20):
                await b.execute_batch([(s, "bash", {"command": f"echo {i}"}) for s in use])
            for _ in range(runs):
                Responder.spent_ns = 0
                gc0 = sum(g["collections"] for g in gc.get_stats())
                n = rounds = 0
                t0, c0 = time.perf_counter(), tt()
                while time.perf_counter() - t0 < seconds:
                    rs = await b.execute_batch([(s, "bash", {"command": f"echo {rounds}"}) for s in use])
                    assert rs[-1].output == f"{rounds}\n", rs[-1]
                    n += len(rs)
                    rounds += 1
                cpu = tt() - c0 - Responder.spent_ns
                wall = time.perf_counter() - t0
                rows.append({"host_us_per_call": cpu / n / 1e3, "calls_per_s": n / wall,
                             "responder_us_per_call": Responder.spent_ns / n / 1e3,
                             "gc_per_round": (sum(g["collections"] for g in gc.get_stats()) - gc0) / rounds})
        finally:
            for sb in boxes:
                sb.handle = sb.handle.real
        for s in use:
            await b.release(s)
    finally:
        await b.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sandboxes", type=int, default=8)
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=3.0, help="each run's length")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows = asyncio.run(measure(args.sandboxes, args.slots, args.seconds, args.runs))
    for r in rows:
        print(f"{args.sandboxes} sandboxes x {args.slots} slots: host {r['host_us_per_call']:.2f} us/call "
              f"({r['calls_per_s']:,.0f} calls/s with the agents bypassed; responder "
              f"{r['responder_us_per_call']:.2f} us/call subtracted; {r['gc_per_round']:.2f} gc runs per round)")
    print(f"HOST_CALLS_US {min(r['host_us_per_call'] for r in rows):.2f}")


if __name__ == "__main__":
    main()
