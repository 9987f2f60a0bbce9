"""Live output: one slot's streaming throughput, and a neighbour's latency under a flood.

Measured in one run, side by side:

- throughput: ``head -c SIZE /dev/zero`` streamed through ``execute(..., on_output=...)``
  (text events, and exact bytes with ``encoding="bytes"``) in MB/s, against
  ``subprocess`` reading the same command's stdout in 64 KiB reads on this host (the
  floor: no sandbox, no protocol);
- neighbour latency: ``echo hi`` round trips in a second slot of the same sandbox, alone
  (baseline) and while the first slot streams ``yes`` (target: p99 under 50 ms).

Usage::

    .venv/bin/python benchmarks/streaming.py [--mb 100] [--echoes 300]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine  # noqa: E402

from hermes_modal_tool import OutputEvent, SandboxConfig, ToolBackend  # noqa: E402


def subprocess_mb_s(size: int) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen(["bash", "-c", f"head -c {size} /dev/zero"], stdout=subprocess.PIPE)
    got = 0
    assert proc.stdout is not None
    while chunk := proc.stdout.read1(65536):
        got += len(chunk)
    proc.wait()
    assert got == size
    return size / 1e6 / (time.perf_counter() - t0)


async def stream_mb_s(backend: ToolBackend, slot, size: int, encoding: str) -> float:
    got = [0]

    def count(event: OutputEvent) -> None:
        got[0] += len(event.data)

    t0 = time.perf_counter()
    r = await backend.execute(slot, "bash", {"command": f"head -c {size} /dev/zero", "encoding": encoding,
                                             "timeout": 600}, on_output=count)
    elapsed = time.perf_counter() - t0
    assert r.success and got[0] == size, (r.error, got[0])
    return size / 1e6 / elapsed


async def echoes(backend: ToolBackend, slot, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await backend.execute(slot, "bash", {"command": "echo hi"})
        out.append(time.perf_counter() - t0)
    return out


def fmt(lat: list[float]) -> str:
    q = statistics.quantiles(lat, n=100)
    return f"median {statistics.median(lat) * 1e3:6.2f} ms  p99 {q[98] * 1e3:6.2f} ms  max {max(lat) * 1e3:6.2f} ms"


async def measure(mb: int, n_echoes: int) -> dict:
    """Both figures in one run: ``{"mb", "rows": [(label, MB/s)], "alone": [s],
    "under": [s], "flood_mb_s"}`` (latencies in seconds)."""
    size = mb * 1_000_000
    config = SandboxConfig(driver="local", name="stream" + uuid.uuid4().hex[:6], slots_per_sandbox=2,
                           min_sandboxes=1, max_sandboxes=1, cpu=2.0, output_limit=50_000)
    async with ToolBackend(config) as backend:
        heavy = await backend.acquire("heavy")
        quiet = await backend.acquire("quiet")
        await echoes(backend, quiet, 20)  # warm
        rows = [("subprocess reading the same command (floor)", subprocess_mb_s(size))]
        rows.append(("ours, text events", await stream_mb_s(backend, heavy, size, "text")))
        rows.append(("ours, exact bytes", await stream_mb_s(backend, heavy, size, "bytes")))
        base = await echoes(backend, quiet, n_echoes)
        streamed = [0]
        flowing = asyncio.Event()

        def count(event: OutputEvent) -> None:
            streamed[0] += len(event.data)
            if streamed[0] >= 1_000_000:
                flowing.set()

        flood = asyncio.ensure_future(backend.execute(heavy, "bash", {"command": "yes", "timeout": 600},
                                                      on_output=count))
        try:
            await asyncio.wait_for(flowing.wait(), 60)
            t0, before = time.perf_counter(), streamed[0]
            under = await echoes(backend, quiet, n_echoes)
            flood_mb_s = (streamed[0] - before) / 1e6 / (time.perf_counter() - t0)
        finally:
            flood.cancel()
            try:
                await flood
            except asyncio.CancelledError:
                pass
    return {"mb": mb, "rows": rows, "alone": base, "under": under, "flood_mb_s": flood_mb_s}


def render(res: dict) -> list[str]:
    """The figures of :func:`measure` as report lines."""
    out = [f"streaming throughput, one slot, {res['mb']} MB of `head -c /dev/zero`:"]
    for name, mb_s in res["rows"]:
        out.append(f"  {name:45s} {mb_s:8.1f} MB/s")
    out.append(f"neighbour `echo hi` in the same sandbox (n={len(res['under'])}; target p99 < 50 ms):")
    out.append(f"  {'alone (baseline)':45s} {fmt(res['alone'])}")
    out.append(f"  {'while the other slot streams `yes`':45s} {fmt(res['under'])}  "
               f"(the flood: ~{res['flood_mb_s']:.1f} MB/s)")
    return out


async def main(args: argparse.Namespace) -> None:
    res = await measure(args.mb, args.echoes)
    info = machine()
    print(", ".join(f"{k}={v}" for k, v in info.items() if not isinstance(v, dict)))
    print("\n".join(render(res)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=100, help="MB to stream (default 100)")
    parser.add_argument("--echoes", type=int, default=300, help="neighbour echoes per phase")
    asyncio.run(main(parser.parse_args()))
