"""Neighbour latency: how long a slot's ``echo`` takes while another slot of the same
sandbox does something heavy (the hardening issue's "nothing a slot can make large runs
on the agent's event loop").

One sandbox, two slots: the *neighbour* runs ``echo hi`` back to back and records each
round trip; the *heavy* slot, meanwhile, runs one operation at a time:

- ``reset``: release (with reset) of a workspace holding ``--dirs`` sibling directories
  (25,000 by default);
- ``archive``: ``archive_artifacts`` of a directory of ``--files`` small files (100,000);
- ``read_file``: ``read_file`` with ``limit=1`` and with the default limit, of a 64 MiB
  file of short lines;
- ``flood``: a command printing as fast as it can for 3 s (``yes``), output capped.

Printed per operation: its own duration, the neighbour's echo count, median, p99 and
maximum (target: p99 under 50 ms), with a baseline (nothing heavy running) measured in
the same run; then the agent's peak resident memory (``VmHWM``) and this process's.
Both file system modes run by default (``--filesystem auto,workspace-only``).

Usage::

    .venv/bin/python benchmarks/neighbours.py [--dirs 25000] [--files 100000] [--json F]
        [--disk-limit auto|kernel|watch]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine  # noqa: E402
from _proc import quantile  # noqa: E402

from hermes_modal_tool import SandboxConfig, ToolBackend  # noqa: E402

TARGET_P99_MS = 50.0


async def call(backend: ToolBackend, slot: Any, tool: str, **args: Any) -> Any:
    [result] = await backend.execute_batch([(slot, tool, args)])
    return result


async def echo_loop(backend: ToolBackend, slot: Any, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        r = await call(backend, slot, "bash", command="echo hi")
        out.append(time.perf_counter() - t0)
        if r.output != "hi\n":
            raise RuntimeError(f"the neighbour's echo came back wrong: {r.output!r} {r.error!r}")
        await asyncio.sleep(0.002)


async def measured(backend: ToolBackend, neighbour: Any, heavy) -> dict[str, Any]:
    """Run ``heavy()`` while the neighbour echoes; the echo latencies and heavy's time."""
    stop, lat = asyncio.Event(), []
    loop_task = asyncio.ensure_future(echo_loop(backend, neighbour, stop, lat))
    await asyncio.sleep(0.2)  # the loop is running before the heavy operation starts
    t0 = time.perf_counter()
    note = await heavy()
    took = time.perf_counter() - t0
    await asyncio.sleep(0.2)
    stop.set()
    await loop_task
    ms = [x * 1e3 for x in lat]
    return {"op_s": round(took, 3), "echoes": len(ms), "p50_ms": round(quantile(ms, 0.5), 2),
            "p99_ms": round(quantile(ms, 0.99), 2), "max_ms": round(max(ms), 2),
            "ok": quantile(ms, 0.99) < TARGET_P99_MS, "note": note}


def vm_hwm_mib(pid: int | None) -> int | None:
    """Peak resident memory of process ``pid`` (MiB), or None."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("VmHWM")).split()[1]) // 1024
    except (OSError, StopIteration, ValueError, TypeError):
        return None


async def run_mode(filesystem: str, dirs: int, files: int, disk_limit: str = "auto") -> dict[str, Any]:
    backend = ToolBackend(SandboxConfig(name="neighbours", slots_per_sandbox=2, min_sandboxes=1,
                                        max_sandboxes=1, filesystem=filesystem,
                                        execution_timeout_s=300, memory=4096,
                                        disk_limit=disk_limit))  # type: ignore[arg-type]
    await backend.start()
    rows: dict[str, Any] = {}
    try:
        neighbour, heavy = await backend.acquire("neighbour"), await backend.acquire("heavy")
        pool = backend.get_status()["pools"]["neighbours"]
        agent_pid = backend._pools["neighbours"].info.get("pid")  # the agent's host pid (local)

        async def idle() -> str:
            await asyncio.sleep(2.0)
            return "nothing heavy"

        rows["baseline"] = await measured(backend, neighbour, idle)

        async def prepare(command: str) -> None:
            r = await call(backend, heavy, "bash", command=f"cd {heavy.workspace_dir} && {command}",
                           timeout=300)
            if not r.success:
                raise RuntimeError(f"setting up failed: {r.error} {r.output[-300:]}")

        await prepare(f"mkdir many && cd many && seq {dirs} | xargs mkdir")

        async def reset() -> str:
            nonlocal heavy
            await backend.release(heavy, reset_workspace=True)
            heavy = await backend.acquire("heavy")
            return f"{dirs} sibling directories"

        rows["reset"] = await measured(backend, neighbour, reset)
        await prepare(f"mkdir files && cd files && python3 -c 'import os\nfor i in range({files}): "
                      f"open(str(i), \"w\").write(\"x\")'")

        async def archive() -> str:
            r = await call(backend, heavy, "archive_artifacts", path="files")
            return f"{files} files: {r.metadata.get('entries', r.error)} entries"

        rows["archive"] = await measured(backend, neighbour, archive)
        await prepare("python3 -c 'import sys\nsys.stdout.write(\"ab\\n\" * ((64 << 20) // 3))' > big.txt")

        async def read_one() -> str:
            r = await call(backend, heavy, "read_file", path="big.txt", limit=1)
            return f"64 MiB file, limit=1: {len(r.output)} chars back {r.error or ''}"

        rows["read_file_limit_1"] = await measured(backend, neighbour, read_one)

        async def read_default() -> str:
            r = await call(backend, heavy, "read_file", path="big.txt")
            return f"64 MiB file, default limit: {len(r.output)} chars back {r.error or ''}"

        rows["read_file_default"] = await measured(backend, neighbour, read_default)

        async def flood() -> str:
            r = await call(backend, heavy, "bash", command="timeout 3 yes; true", timeout=30)
            return f"3 s of yes: {len(r.output)} chars back, truncated={r.metadata.get('truncated')}"

        rows["flood"] = await measured(backend, neighbour, flood)
        return {"filesystem": pool.get("filesystem"), "rows": rows, "agent_peak_mib": vm_hwm_mib(agent_pid),
                "disk": pool["caps"]["disk"]["enforced"].split(":")[0]}
    finally:
        await backend.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dirs", type=int, default=25000)
    ap.add_argument("--files", type=int, default=100000)
    ap.add_argument("--filesystem", default="auto,workspace-only")
    ap.add_argument("--disk-limit", default="auto", choices=("auto", "kernel", "watch"),
                    help="the profile's disk_limit (how slot_disk holds; default auto)")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    report: dict[str, Any] = {"machine": machine(), "modes": {}}
    bad = 0
    for fs in args.filesystem.split(","):
        res = asyncio.run(run_mode(fs, args.dirs, args.files, args.disk_limit))
        report["modes"][fs] = res
        print(f"\nfilesystem={fs} (slots: {res['filesystem']}; disk: {res.get('disk', '?')}); "
              f"agent peak RSS {res['agent_peak_mib']} MiB")
        print(f"  {'operation':<20} {'op s':>8} {'echoes':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}  <50ms  note")
        for name, row in res["rows"].items():
            bad += 0 if row["ok"] else 1
            print(f"  {name:<20} {row['op_s']:>8.2f} {row['echoes']:>7} {row['p50_ms']:>8.2f} "
                  f"{row['p99_ms']:>8.2f} {row['max_ms']:>8.2f}  {'yes' if row['ok'] else 'NO ':<5} {row['note']}")
    host_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    report["host_peak_mib"] = host_peak
    print(f"\nthis process (the host) peak RSS: {host_peak} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
