"""Fork benchmark: start rollouts from a prepared state three ways, side by side.

For a state of ``--mb`` MB in ``--files`` files (default 200 MB in 20,000), measured in
one run on the local driver:

a. redo the setup per rollout: the command that makes the state, in a fresh slot;
b. copy the state per rollout: ``cp -a`` of the state directory inside a slot;
c. our fork: ``snapshot`` once, then ``fork`` (a fresh upper over the frozen layer):
   the latency of one fork at a small state (``--small-mb``) and at the full state
   (within 2x of each other is the target), a 16-way fork of the group (into slots
   never used before, then again into the same slots, as the next step of a training
   loop does), the disk each of 16 forks uses before it writes anything, and the first
   command in a fork.

Also printed: the peak memory (VmHWM) of this process and of each sandbox agent.

Usage::

    .venv/bin/python benchmarks/fork.py                      # 200 MB / 20,000 files
    .venv/bin/python benchmarks/fork.py --mb 20 --files 2000 # quick check
    .venv/bin/python benchmarks/fork.py --json /tmp/fork.json
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

from hermes_modal_tool import SandboxConfig, Slot, ToolBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared benchmark helpers
from _proc import descendants  # noqa: E402

perf = time.perf_counter
TARGETS = {"fork_ms": 20.0, "fork_size_ratio": 2.0, "fork16_ms": 300.0, "disk_per_fork_mib": 1.0}
MAKE_STATE = ("python3 - <<'EOF'\nimport os\nsize, n = {size}, {n}\nblob = os.urandom(size // n)\n"
              "for d in range(max(1, n // 1000)):\n    os.makedirs('/workspace/state/d%d' % d, exist_ok=True)\n"
              "for i in range(n):\n    with open('/workspace/state/d%d/f%d' % (i % max(1, n // 1000), i), 'wb') as f:\n"
              "        f.write(blob)\nEOF\ncd /workspace/state && export STATE_READY=1")


async def run_ok(backend: ToolBackend, slot: Slot, command: str, timeout: float = 600) -> str:
    [r] = await backend.execute_batch([(slot, "bash", {"command": command, "timeout": timeout})])
    if not r.success:
        raise RuntimeError(f"{command[:60]!r} failed: {r.error} {r.output[-500:]}")
    return r.output


def upper_bytes(slot: Slot) -> int:
    """Blocks of the slot's writable layer (local driver: its state dir on this host)."""
    found = glob.glob(f"/tmp/hermes-modal-tool-*/{slot.sandbox_id}/fs/slot_{slot.index}/current")
    if not found:
        return -1
    layer = os.path.join(os.path.dirname(found[0]), os.readlink(found[0]))
    total = 0
    for sub in ("upper", "layers"):
        for root, dirs, files in os.walk(os.path.join(layer, sub)):
            for name in dirs + files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except OSError:
                    pass
    return total


def hwm_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def agent_hwm_mib() -> list[float]:
    out = []
    for pid in descendants(os.getpid(), live_only=True):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if b"hermes_modal_tool.agent.main" not in fh.read():
                    continue
        except OSError:
            continue
        out.append(round(hwm_kib(pid) / 1024, 1))
    return out


async def fork_latency(backend: ToolBackend, snap: Any, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t = perf()
        [f] = await backend.fork(snap, 1)
        times.append((perf() - t) * 1e3)
        await backend.release(f, reset_workspace=True)
    return times


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    size, n = args.mb * 1_000_000, args.files
    small_size, small_n = args.small_mb * 1_000_000, max(1, args.files // 100)
    cfg = SandboxConfig(name=f"fork{uuid.uuid4().hex[:6]}", slots_per_sandbox=args.group + 4,
                        min_sandboxes=1, max_sandboxes=1, acquire_timeout_s=120,
                        execution_timeout_s=900, snapshot_disk=64 * 1024)
    rep: dict[str, Any] = {"state": {"mb": args.mb, "files": n}, "targets": TARGETS}
    async with ToolBackend(cfg) as backend:
        # (a) redo the setup per rollout
        setup = MAKE_STATE.format(size=size, n=n)
        times = []
        for _ in range(args.reps_slow):
            slot = await backend.acquire()
            t = perf()
            await run_ok(backend, slot, setup)
            times.append(perf() - t)
            await backend.release(slot, reset_workspace=True)
        rep["a_setup_per_rollout_s"] = round(statistics.median(times), 3)
        # (b) cp -a per rollout
        parent = await backend.acquire("parent")
        await run_ok(backend, parent, setup)
        times = []
        for i in range(args.reps_slow):
            t = perf()
            await run_ok(backend, parent, f"cp -a /workspace/state /workspace/copy{i}")
            times.append(perf() - t)
        await run_ok(backend, parent, "rm -rf /workspace/copy*")
        rep["b_cp_per_rollout_s"] = round(statistics.median(times), 3)
        # (c) our fork
        t = perf()
        big = await backend.snapshot(parent)
        rep["c_snapshot_once_ms"] = round((perf() - t) * 1e3, 1)
        small_slot = await backend.acquire("small")
        await run_ok(backend, small_slot, MAKE_STATE.format(size=small_size, n=small_n))
        small = await backend.snapshot(small_slot)
        await fork_latency(backend, big, 2)  # warm
        lat_big = await fork_latency(backend, big, args.reps)
        lat_small = await fork_latency(backend, small, args.reps)
        rep["c_fork_ms"] = {f"{args.small_mb} MB": round(statistics.median(lat_small), 2),
                            f"{args.mb} MB": round(statistics.median(lat_big), 2)}
        rep["c_fork_size_ratio"] = round(statistics.median(lat_big) / statistics.median(lat_small), 2)
        await backend.release(small_slot)
        await backend.release_snapshot(small)
        await asyncio.sleep(0.5)
        t = perf()
        group = await backend.fork(big, args.group)
        rep["c_fork16_ms"] = round((perf() - t) * 1e3, 1)
        disk = [upper_bytes(s) for s in group]
        rep["c_disk_per_unwritten_fork_mib"] = round(max(disk) / 2**20, 3) if disk else None
        t = perf()
        outs = await backend.execute_batch([(s, "bash", {"command": "echo $STATE_READY; pwd; ls | wc -l"})
                                            for s in group])
        rep["c_first_command_in_16_forks_ms"] = round((perf() - t) * 1e3, 1)
        assert all(o.output.split()[:2] == ["1", "/workspace/state"] for o in outs), outs[0]
        rep["c_snapshot_size_mib"] = round(big.size_bytes / 2**20, 1)
        await asyncio.gather(*(backend.release(s, reset_workspace=True) for s in group))
        await asyncio.sleep(0.5)  # the slots' next layers are prepared in the background
        t = perf()
        group = await backend.fork(big, args.group)  # the same slots again (as in RL steps)
        rep["c_fork16_warm_ms"] = round((perf() - t) * 1e3, 1)
        await asyncio.gather(*(backend.release(s) for s in group))
        await backend.release_snapshot(big)
        rep["peak_memory_mib"] = {"this_process": round(hwm_kib(os.getpid()) / 1024, 1),
                                  "agents": agent_hwm_mib()}
    rep["group"] = args.group
    return rep


def show(rep: dict[str, Any]) -> None:
    st = rep["state"]
    print(f"state: {st['mb']} MB in {st['files']} files; group of {rep['group']}")
    print(f"(a) redo setup per rollout      {rep['a_setup_per_rollout_s'] * 1e3:10.1f} ms per rollout")
    print(f"(b) cp -a per rollout           {rep['b_cp_per_rollout_s'] * 1e3:10.1f} ms per rollout")
    print(f"(c) fork per rollout            {list(rep['c_fork_ms'].values())[-1]:10.2f} ms "
          f"(target <= {TARGETS['fork_ms']:g} ms)")
    print(f"    snapshot, once              {rep['c_snapshot_once_ms']:10.1f} ms "
          f"(state {rep['c_snapshot_size_mib']} MiB)")
    print(f"    fork latency by state size  {rep['c_fork_ms']}  ratio {rep['c_fork_size_ratio']} "
          f"(target <= {TARGETS['fork_size_ratio']:g})")
    print(f"    {rep['group']}-way fork of the group   {rep['c_fork16_ms']:10.1f} ms "
          f"(target <= {TARGETS['fork16_ms']:g} ms)")
    print(f"    again, slots used before    {rep['c_fork16_warm_ms']:10.1f} ms")
    print(f"    disk per unwritten fork     {rep['c_disk_per_unwritten_fork_mib']:10.3f} MiB "
          f"(target <= {TARGETS['disk_per_fork_mib']:g} MiB)")
    print(f"    first command in {rep['group']} forks   {rep['c_first_command_in_16_forks_ms']:10.1f} ms "
          "(includes their shells' start)")
    print(f"peak memory: this process {rep['peak_memory_mib']['this_process']} MiB, "
          f"agents {rep['peak_memory_mib']['agents']} MiB")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=200, help="state size, MB (default 200)")
    ap.add_argument("--files", type=int, default=20_000, help="files in the state (default 20,000)")
    ap.add_argument("--small-mb", type=int, default=2, help="the small state for the latency ratio (MB)")
    ap.add_argument("--group", type=int, default=16, help="forks in the group (default 16)")
    ap.add_argument("--reps", type=int, default=10, help="single-fork repetitions (median)")
    ap.add_argument("--reps-slow", type=int, default=2, help="repetitions of (a) and (b) (median)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("forks need a layered root: run as root", file=sys.stderr)
        return 2
    rep = asyncio.run(bench(args))
    show(rep)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rep, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
