"""The Ray driver on a two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``).

One cluster for the module (a head and one worker node, each with 2 CPUs and a 100 MB
object store; the worker node alone has the custom resource ``rollout``), joined by this
process; every sandbox is a Ray actor running the real agent with bubblewrap slots on its
node. A subset of the shared driver behaviour suite (tests/test_shared_behaviour.py) runs
here with ``driver="ray"``; then placement by a custom resource, a small load spread over
both nodes, the host's stream refusing a wrong token, an orphaned sandbox, and last (it
removes the worker node) a node lost mid-batch.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support import SMALL, bash, eventually

from hermes_modal_tool import SandboxConfig, ToolBackend
from hermes_modal_tool.errors import SandboxStartError

# Everything on loopback: with this (read when ray is imported) Ray takes 127.0.0.1 as every
# node's address instead of the machine's outward one, and ray.init keeps 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report to the internet
if os.environ.get("CI", "").lower() == "true":
    import ray  # under CI a missing extra (or a module shadowing it) is an error, never a skip
else:
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (scripts/setup.sh dev installs it)")

# The subset of the shared behaviour suite that runs on Ray too (each one is collected
# here again; the module's ``driver`` fixture below makes it use the Ray driver).
from test_shared_behaviour import (  # noqa: E402,F401
    test_a_batch_runs_its_slots_in_parallel,
    test_cd_and_export_persist_between_calls,
    test_files_move_in_chunks_and_release_says_what_the_lease_used,
    test_slots_cannot_see_each_others_files_or_processes,
)

MB = 1024 * 1024
NODE = {"num_cpus": 2, "object_store_memory": 100 * MB, "node_ip_address": "127.0.0.1"}
# Ray's default health check gives a killed node up to ~15 s before the cluster calls it
# dead; here 0.5 s x 3, so the replacement of a lost node's sandbox is not sent back to it.
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                 "health_check_initial_delay_ms": 0}


@pytest.fixture(scope="module")
def ray_cluster():
    """A head node and a worker node (with ``rollout: 4``) on this machine, joined by this
    process; shut down (every Ray process of it) at the end of the module."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        **NODE, "include_dashboard": False, "_system_config": SYSTEM_CONFIG})
    try:
        cluster.worker = cluster.add_node(**NODE, resources={"rollout": 4})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, _node_ip_address="127.0.0.1")
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def driver(ray_cluster) -> str:
    """The shared suite's ``driver`` parameter, here always ``ray``."""
    return "ray"


def _handles(backend: ToolBackend) -> list:
    """The Ray handles of the default profile's running sandboxes."""
    return [sb.handle for sb in backend._pools[backend.default_profile]._sandboxes.values() if not sb.dead]


def _node_of(backend: ToolBackend, slot) -> str:
    return backend._pools[backend.default_profile].record_of(slot).sandbox.handle.node_id


async def _ray_backend(make_backend, name: str, driver_options: dict | None = None, **fields) -> ToolBackend:
    """A started backend of one Ray profile (SMALL plus ``fields``), stopped and checked
    for leftovers at the end of the test."""
    config = SandboxConfig(**{**SMALL, "name": name, "driver": "ray", **fields})
    backend = ToolBackend(make_backend.leftovers.tag(config), driver_options={"ray": driver_options or {}})
    return await make_backend.adopt(backend, start=True)


async def test_placement_by_a_custom_resource(make_backend, ray_cluster):
    """``resources: {rollout: 1}``, which only the worker node has: with ``spread`` (which
    spreads sandboxes over both nodes: see the load test), both sandboxes go there."""
    worker = ray_cluster.worker.node_id
    placed = await _ray_backend(make_backend, "placed", {"placement": "spread", "resources": {"rollout": 1}},
                                min_sandboxes=2, max_sandboxes=2, cpu=0.5)
    assert [h.node_id for h in _handles(placed)] == [worker, worker]
    slot = await placed.acquire("placed")
    r = await bash(placed, slot, "echo on-$((6*7))")
    assert r.output == "on-42\n"
    status = placed.get_status()
    assert status["drivers"]["ray"]["nodes"] == 2 and status["drivers"]["ray"]["resources"] == {"rollout": 1}


async def test_a_request_no_node_meets_fails_with_what_it_asked(make_backend, ray_cluster):
    backend = await _ray_backend(make_backend, "toobig", {"resources": {"no-such-resource": 1},
                                                          "start_timeout": 1.5},
                                 min_sandboxes=0, acquire_timeout_s=3)
    with pytest.raises(SandboxStartError) as err:
        await backend.acquire("nowhere")
    assert "no-such-resource=1" in str(err.value) and "rollout=4" in str(err.value), err.value


async def test_small_load_across_nodes_loses_nothing(make_backend, ray_cluster):
    backend = await _ray_backend(make_backend, "load", {"placement": "spread"}, slots_per_sandbox=4,
                                 min_sandboxes=2, max_sandboxes=2, cpu=0.5, acquire_timeout_s=30)
    slots = [await backend.acquire(f"load-{i}") for i in range(8)]
    nodes = {_node_of(backend, s) for s in slots}
    assert nodes == {ray_cluster.head_node.node_id, ray_cluster.worker.node_id}  # spread: both nodes
    for n in range(25):
        results = await backend.execute_batch(
            [(s, "bash", {"command": f"echo {i}-{n}"}) for i, s in enumerate(slots)])
        assert [r.output for r in results] == [f"{i}-{n}\n" for i in range(len(slots))], results
    status = backend.get_status()["pools"]["load"]
    assert status["sandboxes_died"] == 0 and status["healthy_sandboxes"] == 2


async def test_the_stream_refuses_a_wrong_token_before_any_frame(ray_cluster, tmp_path):
    """Also: a starting actor removes the directories of actors that are gone (killed
    before they could) on its node, and only those."""
    from hermes_modal_tool import protocol
    from hermes_modal_tool.drivers._ray_actor import ROOT_PREFIX, SandboxActor

    dead = await asyncio.create_subprocess_exec("true")
    await dead.wait()
    stale = Path("/dev/shm") / f"{ROOT_PREFIX}{dead.pid}-test"
    live = Path("/dev/shm") / f"{ROOT_PREFIX}{os.getpid()}-test"
    for d in (stale, live):
        (d / "sub").mkdir(parents=True)
    config = SandboxConfig(**{**SMALL, "name": "token", "driver": "ray"})
    token = os.urandom(32)
    actor = ray.remote(SandboxActor).options(num_cpus=0.5).remote()
    try:
        where = await actor.start.remote(config, "token-0", token, {})
        assert not stale.exists() and live.exists()
        init = protocol.encode({"id": 1, "op": "init", "config": where["init"]})

        async def reply_to(prefix: bytes) -> bytes:
            reader, writer = await asyncio.open_connection(where["host"], where["port"])
            writer.write(prefix + init)
            try:
                return await asyncio.wait_for(reader.read(1 << 16), 20)
            except ConnectionError:
                return b""
            finally:
                writer.close()

        assert await reply_to(bytes(32)) == b""  # a wrong token: closed, no answer
        assert await reply_to(token[:31] + bytes([token[31] ^ 1])) == b""
        [reply] = protocol.FrameDecoder().feed(await reply_to(token))  # positive control
        assert reply["id"] == 1 and reply["ok"], reply
    finally:
        await actor.stop.remote()
        ray.kill(actor)
        for d in (stale, live):
            shutil.rmtree(d, ignore_errors=True)


ORPHAN_OWNER = textwrap.dedent("""
    import asyncio, sys, time, ray
    from hermes_modal_tool import SandboxConfig, ToolBackend
    ray.init(address=sys.argv[1], log_to_driver=False, _node_ip_address="127.0.0.1")
    async def main():
        backend = ToolBackend(SandboxConfig(name="orphan", driver="ray", slots_per_sandbox=1,
                                            min_sandboxes=1, max_sandboxes=1, memory=256))
        await backend.start()
        [sb] = backend._pools["orphan"]._sandboxes.values()
        print(sb.handle.agent_pid, sb.handle.actor_pid, flush=True)
        await asyncio.sleep(600)
    asyncio.run(main())
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_an_orphaned_sandbox_ends_with_its_owner(ray_cluster):
    """The host process dies (SIGKILL): its sandbox's actor and agent end without it."""
    owner = await asyncio.create_subprocess_exec(sys.executable, "-c", ORPHAN_OWNER, ray_cluster.address,
                                                 stdout=asyncio.subprocess.PIPE)
    try:
        line = await asyncio.wait_for(owner.stdout.readline(), 60)
        agent_pid, actor_pid = map(int, line.split())
        assert _alive(agent_pid) and _alive(actor_pid)  # positive control: the sandbox ran
    finally:
        owner.kill()
        await owner.wait()
    gone = await eventually(lambda: asyncio.sleep(0, (_alive(agent_pid), _alive(actor_pid))),
                            lambda alive: alive == (False, False), timeout=20)
    assert gone == (False, False), "the orphan's agent or actor still runs"


async def test_a_lost_node_fails_only_its_calls_and_the_pool_replaces_it(make_backend, ray_cluster):
    """Last in the module: it removes the worker node (SIGKILL, no graceful drain)."""
    worker = ray_cluster.worker.node_id
    backend = await _ray_backend(make_backend, "lost", {"placement": "spread"}, slots_per_sandbox=2,
                                 min_sandboxes=2, max_sandboxes=2, cpu=0.5, execution_timeout_s=60,
                                 acquire_timeout_s=30)
    slots = [await backend.acquire(f"lost-{i}") for i in range(4)]
    on_worker = [_node_of(backend, s) == worker for s in slots]
    assert on_worker.count(True) == 2, on_worker
    batch = asyncio.ensure_future(backend.execute_batch(
        [(s, "bash", {"command": f"echo start-{i}; sleep 4; echo done-{i}"}) for i, s in enumerate(slots)]))
    await asyncio.sleep(1.5)
    assert not batch.done()
    killed_at = time.monotonic()
    await asyncio.to_thread(ray_cluster.remove_node, ray_cluster.worker, False)
    results = await asyncio.wait_for(batch, 20)
    for i, (r, lost) in enumerate(zip(results, on_worker, strict=True)):
        if lost:
            assert not r.success and f"Ray node {worker[:12]}" in r.error, r
        else:
            assert r.success and r.output == f"start-{i}\ndone-{i}\n", r
    assert time.monotonic() - killed_at < 8
    for s in slots:
        await backend.release(s)
    status = await eventually(lambda: asyncio.sleep(0, backend.get_status()),
                              lambda st: st["pools"]["lost"]["healthy_sandboxes"] == 2, timeout=30)
    assert status["pools"]["lost"]["sandboxes_died"] == 1
    assert {h.node_id for h in _handles(backend)} == {ray_cluster.head_node.node_id}
    fresh = [await backend.acquire(f"after-{i}") for i in range(4)]
    results = await backend.execute_batch([(s, "bash", {"command": "echo alive"}) for s in fresh])
    assert [r.output for r in results] == ["alive\n"] * 4


@pytest.mark.parametrize(("options", "named"), [
    ({"placement": "diagonal"}, "placement 'diagonal'"),
    ({"resources": {"rollout": -1}}, "resources['rollout']"),
    ({"start_timeout": 0}, "start_timeout"),
    ({"no_such_option": 1}, "no_such_option"),
])
def test_a_bad_driver_option_is_named(options, named):
    from hermes_modal_tool.drivers import make_driver
    from hermes_modal_tool.errors import ConfigError

    assert make_driver("ray").placement == "pack"  # positive control: good options make one
    with pytest.raises(ConfigError, match=re.escape(named)):
        make_driver("ray", **options)
