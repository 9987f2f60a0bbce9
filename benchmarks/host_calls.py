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

``--pipes``: each sandbox's responder is a process of its own (``_responder.py``) on the
far end of real pipes, read and written by the host's event loop as an agent's are: the
host's whole path, pipes and wakeups included, with the agents' CPU on other cores. With
``--parts P --spread-ms T`` it sends a batch's results in P frames, each after a random
delay of up to T ms, as agents under load do (their results come apart in time): the
host's loop then sleeps and wakes between reads. Printed: calls/s, the host's CPU per
call (its main thread, and the process split into user and system time) and its
voluntary context switches (sleeps) per round.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import resource
import subprocess
import sys
import time
from typing import Any

from _engine_backends import cfg, started
from _responder import results

from hermes_modal_tool import protocol

tt = time.thread_time_ns
RESPONDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_responder.py")


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
                out.append(protocol.encode({"id": 0, "results": results(msg)}))
        if out:
            self.loop.call_soon(self.sandbox._on_data, b"".join(out))
        Responder.spent_ns += tt() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class _Replies(asyncio.Protocol):
    def __init__(self, sandbox: Any) -> None:
        self.sandbox = sandbox

    def data_received(self, data: bytes) -> None:
        self.sandbox._on_data(data)


class PipeResponder:
    """Stands in for a sandbox's handle (``write`` only; the rest from the real one): its
    frames go down a pipe to a responder process (``_responder.py``), whose replies come
    back on a pipe the loop reads into the sandbox's reader, as the agent's do."""

    def __init__(self, sandbox: Any, proc: subprocess.Popen, writer: asyncio.WriteTransport,
                 reader: asyncio.ReadTransport) -> None:
        self.sandbox, self.real = sandbox, sandbox.handle
        self.proc, self.writer, self.reader = proc, writer, reader

    @classmethod
    async def start(cls, sandbox: Any, parts: int, spread_ms: float) -> PipeResponder:
        proc = await asyncio.to_thread(subprocess.Popen, [sys.executable, RESPONDER, str(parts), str(spread_ms)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        loop = asyncio.get_running_loop()
        writer, _ = await loop.connect_write_pipe(asyncio.Protocol, proc.stdin)
        reader, _ = await loop.connect_read_pipe(lambda: _Replies(sandbox), proc.stdout)
        return cls(sandbox, proc, writer, reader)

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    async def close(self) -> None:
        """Close both pipes and end the responder (waited for off the loop)."""
        self.writer.close()
        self.reader.close()
        self.proc.terminate()
        await asyncio.to_thread(self.proc.wait)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


async def measure(sandboxes: int, slots: int, seconds: float, runs: int,
                  pipes: tuple[int, float] | None = None) -> list[dict[str, float]]:
    """Rows of ``runs`` timed runs; ``pipes``: ``(parts, spread_ms)`` for responder
    processes over real pipes (:class:`PipeResponder`), else in-process ones."""
    b = await started(cfg(slots_per_sandbox=-(-slots // sandboxes), min_sandboxes=sandboxes,
                          max_sandboxes=sandboxes, scale_down_idle=False))
    rows = []
    try:
        use = [await b.acquire(f"hc-{i}") for i in range(slots)]
        await b.execute_batch([(s, "bash", {"command": "true"}) for s in use])  # every shell started
        boxes = {s._sandbox.sandbox for s in use}
        for sb in boxes:
            sb.handle = Responder(sb) if pipes is None else await PipeResponder.start(sb, *pipes)
        try:
            for i in range(20):
                await b.execute_batch([(s, "bash", {"command": f"echo {i}"}) for s in use])
            for _ in range(runs):
                Responder.spent_ns = 0
                gc0 = sum(g["collections"] for g in gc.get_stats())
                n = rounds = 0
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                t0, c0 = time.perf_counter(), tt()
                while time.perf_counter() - t0 < seconds:
                    rs = await b.execute_batch([(s, "bash", {"command": f"echo {rounds}"}) for s in use])
                    assert rs[-1].output == f"{rounds}\n", rs[-1]
                    n += len(rs)
                    rounds += 1
                cpu = tt() - c0 - Responder.spent_ns
                wall = time.perf_counter() - t0
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                rows.append({"host_us_per_call": cpu / n / 1e3, "calls_per_s": n / wall,
                             "responder_us_per_call": Responder.spent_ns / n / 1e3,
                             "user_us_per_call": (r1.ru_utime - r0.ru_utime) / n * 1e6,
                             "sys_us_per_call": (r1.ru_stime - r0.ru_stime) / n * 1e6,
                             "sleeps_per_round": (r1.ru_nvcsw - r0.ru_nvcsw) / rounds,
                             "gc_per_round": (sum(g["collections"] for g in gc.get_stats()) - gc0) / rounds})
        finally:
            for sb in boxes:
                if isinstance(sb.handle, PipeResponder):
                    await sb.handle.close()
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
    ap.add_argument("--pipes", action="store_true",
                    help="responder processes over real pipes (the host's whole path; see the module doc)")
    ap.add_argument("--parts", type=int, default=1, help="--pipes: frames per batch's results (default 1)")
    ap.add_argument("--spread-ms", type=float, default=0.0,
                    help="--pipes: each frame after a random delay of up to this many ms (default 0)")
    args = ap.parse_args()
    if args.parts < 1 or args.spread_ms < 0:
        ap.error(f"--parts {args.parts} must be >= 1 and --spread-ms {args.spread_ms} >= 0")
    pipes = (args.parts, args.spread_ms) if args.pipes else None
    rows = asyncio.run(measure(args.sandboxes, args.slots, args.seconds, args.runs, pipes))
    for r in rows:
        head = f"{args.sandboxes} sandboxes x {args.slots} slots: host {r['host_us_per_call']:.2f} us/call "
        if pipes is None:
            print(head + f"({r['calls_per_s']:,.0f} calls/s with the agents bypassed; responder "
                  f"{r['responder_us_per_call']:.2f} us/call subtracted; {r['gc_per_round']:.2f} gc runs per round)")
        else:
            print(head + f"in its main thread; process: user {r['user_us_per_call']:.2f} + system "
                  f"{r['sys_us_per_call']:.2f} us/call, {r['sleeps_per_round']:.1f} sleeps per round "
                  f"({r['calls_per_s']:,.0f} calls/s; responder processes over pipes, results in "
                  f"{args.parts} frame(s) per batch spread over {args.spread_ms:g} ms)")
    print(f"HOST_CALLS_US {min(r['host_us_per_call'] for r in rows):.2f}")


if __name__ == "__main__":
    main()
