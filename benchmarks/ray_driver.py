"""The Ray driver against the local driver, in one run on a two-node Ray cluster here.

A ``ray.cluster_utils.Cluster`` of two nodes on this machine (2 CPUs and a 100 MB object
store each, every address on 127.0.0.1); the Ray profile's sandbox is placed on the
worker node (a custom resource only it has), so its stream is a TCP hop to another node's
actor. Measured side by side, same profile (4 slots in one sandbox):

- sandbox start: ``ToolBackend.start()`` with ``min_sandboxes: 1`` until the sandbox's
  agent answered ``init`` (for Ray: actor placement, its worker process, the agent on that
  node and the stream's connection), ``--starts`` times each, a fresh backend every time;
- warm echo: ``echo hi`` round trips in one slot, one at a time (median, p90);
- calls/s: every slot runs ``true`` in one ``execute_batch``, ``--rounds`` batches (the
  median of five pieces);

both backends up at once, the two measurements alternating between them in five pieces
(the machine's other load falls on both alike).

It prints each figure and the ratio Ray/local. ``ray.experimental.sandbox`` (gVisor) is
tried only when ``runsc`` is on PATH; else the line says it was not run.

Usage::

    .venv/bin/python benchmarks/ray_driver.py [--starts 3] [--echoes 300] [--rounds 300]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path

# Every Ray address on loopback (read when ray is imported), and no usage report.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HERMES_MODAL_TOOL_REGISTRY_IMAGES", "host")

# (Not named ray.py: a module of that name in benchmarks/ shadowed the ray package for every
# test process that puts benchmarks/ on sys.path, and the Ray tests were skipped.)
HERE = str(Path(__file__).resolve().parent)
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

sys.path.insert(0, HERE)
from _machine import machine  # noqa: E402

from hermes_modal_tool import SandboxConfig, ToolBackend  # noqa: E402

SLOTS = 4
MB = 1024 * 1024
NODE = {"num_cpus": 2, "object_store_memory": 100 * MB, "node_ip_address": "127.0.0.1"}


def profile(driver: str) -> SandboxConfig:
    return SandboxConfig(name=f"bench-{driver}-{uuid.uuid4().hex[:6]}", driver=driver,
                         slots_per_sandbox=SLOTS, min_sandboxes=1, max_sandboxes=1, cpu=1.0,
                         memory=1024, execution_timeout_s=60)


OPTIONS = {"ray": {"resources": {"bench-worker": 1}}}


async def start_times(driver: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        backend = ToolBackend(profile(driver), driver_options={driver: OPTIONS.get(driver, {})})
        await backend.start()
        out.append(time.perf_counter() - t0)
        await backend.stop()
    return out


async def echoes(backend: ToolBackend, slot, n: int) -> list[float]:
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = await backend.execute(slot, "bash", {"command": "echo hi"})
        lat.append(time.perf_counter() - t0)
        assert r.output == "hi\n", r
    return lat


async def calls_s(backend: ToolBackend, slots, rounds: int) -> float:
    batch = [(s, "bash", {"command": "true"}) for s in slots]
    t0 = time.perf_counter()
    for _ in range(rounds):
        results = await backend.execute_batch(batch)
        assert all(r.success for r in results), results
    return rounds * len(batch) / (time.perf_counter() - t0)


async def warm(n_echoes: int, rounds: int, chunks: int = 5) -> dict:
    """Both drivers' backends up at once; the measurements alternate between them in
    ``chunks`` pieces, so the machine's other load falls on both alike."""
    res: dict = {d: {"lat": [], "calls": []} for d in ("local", "ray")}
    backends = {d: ToolBackend(profile(d), driver_options={d: OPTIONS.get(d, {})}) for d in res}
    async with backends["local"], backends["ray"]:
        slots = {d: [await b.acquire(f"b{i}") for i in range(SLOTS)] for d, b in backends.items()}
        for d, b in backends.items():
            await echoes(b, slots[d][0], 30)  # warm
            await calls_s(b, slots[d], 5)
        for _ in range(chunks):
            for d, b in backends.items():
                res[d]["lat"] += await echoes(b, slots[d][0], max(1, n_echoes // chunks))
                res[d]["calls"].append(await calls_s(b, slots[d], max(1, rounds // chunks)))
        handle = backends["ray"]._pools[backends["ray"].default_profile].record_of(slots["ray"][0]).sandbox.handle
    for d in res:
        res[d]["calls_s"] = statistics.median(res[d].pop("calls"))
    res["ray"]["node"] = handle.node_id
    return res


def gvisor_line() -> str:
    if shutil.which("runsc") is None:
        return ("ray.experimental.sandbox: not run (it needs gVisor's runsc, which is not installed "
                "here)")
    return "ray.experimental.sandbox: runsc found, but this benchmark does not drive it yet"


async def measure(args: argparse.Namespace, cluster) -> dict:
    load = os.getloadavg()[0]
    res = await warm(args.echoes, args.rounds)
    for driver in ("local", "ray"):
        res[driver]["starts"] = await start_times(driver, args.starts)
    res["worker"] = cluster.worker.node_id
    res["load"] = (load, os.getloadavg()[0])
    return res


def ms(x: float) -> str:
    return f"{x * 1e3:7.2f} ms"


def render(res: dict) -> list[str]:
    local, ray_ = res["local"], res["ray"]
    assert ray_["node"] == res["worker"], "the Ray sandbox was not on the worker node"
    rows = []

    def row(name: str, a: float, b: float, unit) -> None:
        rows.append(f"  {name:34s} local {unit(a)}   ray {unit(b)}   ray/local {b / a:6.2f}")

    row("sandbox start, median", statistics.median(local["starts"]), statistics.median(ray_["starts"]), ms)
    row("sandbox start, first", local["starts"][0], ray_["starts"][0], ms)
    row("warm echo, median", statistics.median(local["lat"]), statistics.median(ray_["lat"]), ms)
    p90 = lambda lat: statistics.quantiles(lat, n=10)[8]  # noqa: E731
    row("warm echo, p90", p90(local["lat"]), p90(ray_["lat"]), ms)
    row(f"calls/s, {SLOTS} slots per batch", local["calls_s"], ray_["calls_s"], lambda v: f"{v:8.0f}  ")
    return [f"Ray driver vs local driver, one sandbox of {SLOTS} slots each; the Ray sandbox on the "
            f"worker node of a two-node local cluster (n={len(local['lat'])} echoes, "
            f"{len(local['starts'])} starts; load average {res['load'][0]:.1f} before, "
            f"{res['load'][1]:.1f} after):", *rows, gvisor_line()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=3, help="sandbox starts per driver (default 3)")
    parser.add_argument("--echoes", type=int, default=300, help="warm echo round trips (default 300)")
    parser.add_argument("--rounds", type=int, default=300, help="batches for calls/s (default 300)")
    args = parser.parse_args()
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    try:
        cluster.worker = cluster.add_node(**NODE, resources={"bench-worker": 2})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, _node_ip_address="127.0.0.1")
        res = asyncio.run(measure(args, cluster))
    finally:
        ray.shutdown()
        cluster.shutdown()
    info = machine()
    print(", ".join(f"{k}={v}" for k, v in info.items() if not isinstance(v, dict)))
    print("\n".join(render(res)))


if __name__ == "__main__":
    main()
