"""The usage ledger: ``release()`` and ``usage()`` say what a trajectory used, measured
from its slot's cgroup where there is one; a neighbour's work is not billed to it."""

from __future__ import annotations

import glob
import json
from pathlib import Path

from support import agent_processes, bash

from hermes_modal_tool import Usage
from hermes_modal_tool.usage import from_agent, total_usage

# 0.5 s of CPU (user and system: where clock reads are system calls, most of it is
# system time), however loaded the machine is (python is on the host's root here).
BURN = "python3 -c 'import time\nwhile time.process_time() < 0.5: pass'"
# 64 MiB held in memory for a moment.
HOLD_MEMORY = "python3 -c 'b = bytearray(64 << 20); b[::4096] = b\"x\" * (len(b) // 4096)'"


async def test_release_returns_what_the_trajectory_used(make_backend):
    backend = await make_backend(slots_per_sandbox=2)
    busy = await backend.acquire("busy")
    idle = await backend.acquire("idle")
    # (A minute each: on a loaded machine 0.5 s of CPU can take many seconds to get.)
    assert (await bash(backend, busy, BURN, timeout=60)).success
    assert (await bash(backend, busy, HOLD_MEMORY, timeout=60)).success
    [w] = await backend.execute_batch([(busy, "write_file", {"path": "data.bin", "content": "x" * 300_000})])
    assert w.success
    assert (await bash(backend, idle, "true")).success

    running = await backend.usage(busy)  # while it is held
    assert isinstance(running, Usage) and running.trajectory_id == "busy"
    cgroup = running.source.startswith("cgroup")
    busy_usage = await backend.release(busy, measure_disk=True)
    idle_usage = await backend.release(idle, measure_disk=True)

    assert busy_usage.calls == {"bash": 2, "write_file": 1}
    assert idle_usage.calls == {"bash": 1}
    assert busy_usage.wall_s >= running.wall_s > 0
    assert busy_usage.disk_bytes >= 300_000 and busy_usage.disk_peak_bytes >= busy_usage.disk_bytes
    assert idle_usage.disk_bytes < 100_000
    assert busy_usage.gpu_s is None  # the profile has no GPU
    json.dumps(busy_usage.as_dict())
    if cgroup:  # this machine: the slot's own cgroup (the test says so when it is not)
        # Positive control: the busy loop's 0.5 s are billed to its slot...
        assert busy_usage.cpu_s >= 0.5, busy_usage
        assert busy_usage.memory_peak_bytes >= 64 << 20, busy_usage
        # ... and not to its neighbour in the same sandbox.
        assert idle_usage.cpu_s < 0.2, idle_usage
        assert idle_usage.memory_peak_bytes < 48 << 20, idle_usage
    else:
        assert busy_usage.source == "agent" and busy_usage.cpu_user_s is None


async def test_the_next_tenant_starts_from_zero(make_backend):
    backend = await make_backend(slots_per_sandbox=1, max_sandboxes=1)
    first = await backend.acquire("first")
    assert (await bash(backend, first, BURN + "; " + HOLD_MEMORY + "; head -c 500000 /dev/zero > f",
                       timeout=60)).success
    # The usage request goes out with the reset's: the counters are read before it.
    used = await backend.release(first, reset_workspace=True)
    second = await backend.acquire("second")
    assert second.slot_id == first.slot_id  # the same slot, a new tenant
    assert (await bash(backend, second, "true")).success
    again = await backend.release(second, measure_disk=True)
    assert used.disk_bytes is None  # not measured: the reset stays O(1)
    assert again.disk_bytes < 100_000 and again.disk_peak_bytes < 100_000
    assert again.calls == {"bash": 1}
    assert used.source != "host", used  # the agent answered
    if used.source.startswith("cgroup"):
        assert used.cpu_s >= 0.5 and used.memory_peak_bytes >= 64 << 20
        assert again.cpu_s < 0.2, again
        assert again.memory_peak_bytes < 48 << 20, again


async def test_pool_status_shows_warm_time_no_trajectory_used(make_backend):
    backend = await make_backend(slots_per_sandbox=2)
    slot = await backend.acquire("t")
    await bash(backend, slot, "sleep 0.3; head -c 200000 /dev/zero > f")
    used = await backend.release(slot)
    # Without measure_disk the release walks nothing: no disk figure, the rest is there.
    assert used.disk_bytes is None and used.disk_peak_bytes is None and used.calls == {"bash": 1}
    ledger = backend.get_status()["pools"][backend.default_profile]["usage"]
    # (The ledger rounds to milliseconds.)
    assert ledger["held_seconds"] >= used.wall_s - 0.001 and used.wall_s >= 0.3
    # Two slots warm for at least as long; the idle one was never held.
    assert ledger["slot_seconds"] >= 2 * used.wall_s - 0.001
    assert ledger["unattributed_warm_s"] >= ledger["slot_seconds"] - ledger["held_seconds"] - 0.01
    assert ledger["unattributed_warm_s"] >= used.wall_s - 0.001


def thread_cgroups(pid: int) -> list[str]:
    """``/proc/PID/task/*/cgroup`` of each thread of a process."""
    return [Path(path).read_text() for path in glob.glob(f"/proc/{pid}/task/*/cgroup")]


async def test_the_agents_own_threads_are_never_billed_to_a_slot(make_backend):
    """A shell started from a thread of the agent joins the slot's cgroups with that thread
    only (agent/shells/threadstart.py); the thread must leave every one of them, cpuacct too, or
    the agent's own CPU is billed to whichever slot it started a shell for last."""
    backend = await make_backend(slots_per_sandbox=2)
    slots = [await backend.acquire(f"t{i}") for i in range(2)]
    for slot in slots:
        assert (await bash(backend, slot, "cat /proc/self/cgroup")).success
    [pid] = agent_processes()
    seen = thread_cgroups(pid)
    assert seen  # positive control: the agent's threads were read
    assert not [text for text in seen if "/slot_" in text], seen


def test_total_usage_sums_and_keeps_peaks():
    a = Usage("s0", "a", "p", "cgroup-v1", 1.0, 0.5, 0.1, 100, 10, 20, {"bash": 2})
    b = Usage("s1", "b", "p", "agent", 2.0, None, None, None, 5, 50, {"bash": 1, "read_file": 1})
    total = total_usage([a, b.as_dict()])
    assert total["trajectories"] == 2 and total["wall_s"] == 3.0
    assert total["cpu_user_s"] == 0.5 and total["unknown"]["cpu_user_s"] == 1
    assert total["memory_peak_bytes"] == 100 and total["disk_peak_bytes"] == 50
    assert total["calls"] == {"bash": 3, "read_file": 1}
    assert total["sources"] == {"cgroup-v1": 1, "agent": 1}


def test_gpu_seconds_only_where_the_slot_holds_a_gpu():
    kw = {"slot_id": "s", "trajectory_id": "t", "profile": "p", "wall_s": 2.5, "calls": {}}
    assert from_agent({"source": "agent"}, gpu=True, **kw).gpu_s == 2.5
    assert from_agent({"source": "agent"}, gpu=False, **kw).gpu_s is None
    dead = from_agent(None, gpu=False, note="its sandbox ended", **kw)
    assert dead.source == "host" and dead.notes == ("its sandbox ended",)


async def test_a_local_profiles_gpu_is_not_billed(make_backend):
    backend = await make_backend(gpu="T4")  # the local driver ignores it (and warns)
    slot = await backend.acquire("t")
    used = await backend.release(slot)
    assert used.wall_s > 0 and used.gpu_s is None
