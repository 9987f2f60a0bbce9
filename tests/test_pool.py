"""Pools: warm minimum, growth to the maximum, waiting, batches, reuse, scale-down,
dead sandboxes, stop and cancellation."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest
from support import agent_processes, bash, processes, settle

from hermes_modal_tool import (
    BackendClosedError,
    ExecutionResult,
    PoolTimeoutError,
    SlotState,
    UsageError,
)


def pool_status(backend) -> dict:
    return backend.get_status()["pools"][backend.default_profile]


# -- sizing ----------------------------------------------------------------------------

async def test_min_sandboxes_are_warm_after_start(make_backend):
    backend = await make_backend(min_sandboxes=2, max_sandboxes=3, slots_per_sandbox=2)
    status = backend.get_status()
    assert status["sandboxes"] == 2
    assert status["total_slots"] == 4 and status["available_slots"] == 4
    assert status["slots_per_sandbox"] == 2
    assert len(agent_processes()) == 2


async def test_min_zero_starts_nothing_until_acquire(make_backend):
    backend = await make_backend(min_sandboxes=0, max_sandboxes=1)
    assert backend.get_status()["sandboxes"] == 0
    slot = await backend.acquire("t")
    assert backend.get_status()["sandboxes"] == 1
    assert (await bash(backend, slot, "echo up")).output == "up\n"


async def test_acquire_grows_to_max_sandboxes(make_backend):
    backend = await make_backend(min_sandboxes=1, max_sandboxes=3, slots_per_sandbox=2)
    slots = [await backend.acquire(f"traj-{i}") for i in range(6)]
    assert backend.get_status()["sandboxes"] == 3
    assert len({s.sandbox_id for s in slots}) == 3
    assert len({s.slot_id for s in slots}) == 6
    assert all(s.state is SlotState.ACQUIRED for s in slots)
    assert [s.trajectory_id for s in slots] == [f"traj-{i}" for i in range(6)]
    status = backend.get_status()
    assert status["acquired_slots"] == 6 and status["available_slots"] == 0


async def test_acquire_times_out_with_a_useful_message(make_backend):
    # Both sandboxes warm before the holders come (start() waits for min_sandboxes): on a
    # loaded machine a second sandbox can take longer to start than the 0.5 s wait.
    backend = await make_backend(min_sandboxes=2, max_sandboxes=2, slots_per_sandbox=2,
                                 acquire_timeout_s=0.5)
    for i in range(4):
        await backend.acquire(f"holder-{i}")
    start = time.monotonic()
    with pytest.raises(PoolTimeoutError) as exc:
        await backend.acquire("late")
    elapsed = time.monotonic() - start
    assert 0.45 <= elapsed < 2.5, elapsed
    msg = str(exc.value)
    assert "4 slots" in msg
    for i in range(4):
        assert f"holder-{i}" in msg
    assert backend.get_status()["waiting_acquires"] == 0


async def test_release_wakes_a_waiter(make_backend):
    backend = await make_backend(min_sandboxes=1, max_sandboxes=1, slots_per_sandbox=1,
                                 acquire_timeout_s=5)
    held = await backend.acquire("first")
    await bash(backend, held, "echo left-behind > file.txt")
    waiter = asyncio.ensure_future(backend.acquire("second"))
    await asyncio.sleep(0.3)
    assert not waiter.done()
    assert backend.get_status()["waiting_acquires"] == 1
    start = time.monotonic()
    await backend.release(held)
    slot = await asyncio.wait_for(waiter, 3)
    assert time.monotonic() - start < 2
    assert slot.trajectory_id == "second"
    assert (await bash(backend, slot, "ls -A")).output == ""


# -- batches ---------------------------------------------------------------------------

async def test_batch_runs_slots_in_parallel(make_backend):
    backend = await make_backend(min_sandboxes=2, max_sandboxes=2, slots_per_sandbox=4)
    slots = [await backend.acquire(f"t{i}") for i in range(8)]
    assert len({s.sandbox_id for s in slots}) == 2
    start = time.monotonic()
    results = await backend.execute_batch([(s, "bash", {"command": "sleep 1; echo done"})
                                           for s in slots])
    elapsed = time.monotonic() - start
    assert all(r.success and r.output == "done\n" for r in results)
    assert elapsed < 3, f"8 x sleep 1 over 8 slots took {elapsed:.1f}s"


async def test_results_come_back_in_input_order(make_backend):
    backend = await make_backend(min_sandboxes=1, max_sandboxes=2, slots_per_sandbox=3)
    slots = [await backend.acquire(f"t{i}") for i in range(6)]
    # Later requests finish first.
    requests = [(s, "bash", {"command": f"sleep 0.{5 - i}; echo {i}"}) for i, s in enumerate(slots)]
    results = await backend.execute_batch(requests)
    assert [r.output for r in results] == [f"{i}\n" for i in range(6)]
    assert [r.slot_id for r in results] == [s.slot_id for s in slots]
    assert len({r.execution_id for r in results}) == 6


async def test_a_timeout_in_one_slot_does_not_disturb_its_neighbours(make_backend):
    backend = await make_backend(min_sandboxes=1, max_sandboxes=1, slots_per_sandbox=3)
    a, b, c = [await backend.acquire(f"t{i}") for i in range(3)]
    ra, rb, rc = await backend.execute_batch([
        (a, "bash", {"command": "sleep 30", "timeout": 0.5}),
        (b, "bash", {"command": "sleep 1.5; echo b-ok"}),
        (c, "bash", {"command": "while :; do :; done", "timeout": 0.5}),
    ])
    assert ra.returncode == 124 and rc.returncode == 124
    assert rb.success and rb.output == "b-ok\n"
    assert backend.get_status()["sandboxes"] == 1
    assert pool_status(backend)["sandboxes_died"] == 0


async def test_one_bad_request_fails_only_itself(make_backend):
    backend = await make_backend(min_sandboxes=1, max_sandboxes=1, slots_per_sandbox=2)
    slot = await backend.acquire("good")
    released = await backend.acquire("gone")
    await backend.release(released)
    requests = [
        (slot, "bash", {"command": "echo first"}),
        "not a tuple",
        (slot, "bash", "args are not a dict"),
        (released, "bash", {"command": "echo should-not-run"}),
        (slot, 42, {}),
        ("not a slot", "bash", {"command": "echo x"}),
        (slot, "bash"),
        (slot, "no_such_tool", {}),
        (slot, "bash", {"command": "exit 3"}),
        (slot, "read_file", {"path": "missing.txt"}),
        (slot, "bash", {"command": "echo last"}),
    ]
    results = await backend.execute_batch(requests)
    assert len(results) == len(requests)
    assert all(isinstance(r, ExecutionResult) for r in results)
    assert results[0].success and results[0].output == "first\n"
    assert results[-1].success and results[-1].output == "last\n"
    for i, r in enumerate(results[1:-1], start=1):
        assert not r.success, i
        assert r.error, i
    assert "released" in results[3].error or "not held" in results[3].error
    # Every result has an exit code, or (nothing ran) a named reason instead.
    assert [r.metadata["returncode"] for r in results] == [0, *[None] * 7, 3, 1, 0]
    assert [r.metadata.get("reason") for r in results[1:8]] == [
        "bad_request", "bad_request", "slot_not_held", "bad_request", "bad_request", "bad_request",
        "bad_request"]
    assert all("reason" not in r.metadata for r in results[8:])


async def test_empty_batch(backend):
    assert await backend.execute_batch([]) == []


async def test_bad_batch_arguments_raise(backend, slot):
    with pytest.raises(UsageError):
        await backend.execute_batch("echo hi")
    with pytest.raises(UsageError):
        await backend.execute_batch([(slot, "bash", {"command": "true"})], timeout_s=-1)


# -- reuse -----------------------------------------------------------------------------

@pytest.mark.parametrize("reset_workspace", [True, False])
async def test_released_slot_is_clean_for_the_next_holder(make_backend, reset_workspace):
    backend = await make_backend(min_sandboxes=1, max_sandboxes=1, slots_per_sandbox=1)
    first = await backend.acquire("first")
    r = await bash(backend, first, "mkdir -p deep/dir && echo secret > deep/dir/f && echo x > .hidden "
                                   "&& chmod 000 deep && export LEFT=over && cd /tmp && echo t > /tmp/t")
    assert r.success, r.error
    assert (await bash(backend, first, "sleep 60", background=True)).success
    await backend.release(first, reset_workspace=reset_workspace)
    assert first.state is SlotState.AVAILABLE and first.trajectory_id is None

    second = await backend.acquire("second")
    assert second.slot_id == first.slot_id  # the same slot, reused
    r = await bash(backend, second, 'ls -A; echo --; pwd; echo "${LEFT-unset}"; echo --; '
                                    'ls -A /tmp; echo --; ps -eo args=')
    files, shell, tmp, procs = r.output.split("--\n")
    assert files == ""
    assert shell.splitlines() == [second.workspace_dir, "unset"]
    assert tmp == ""
    assert "sleep 60" not in procs


@pytest.mark.parametrize("reset_workspace", [True, False])
async def test_one_command_is_enough_to_get_a_new_shell(make_backend, reset_workspace):
    # The shell a slot gets after a reset is started ahead of time; a holder that ran a
    # single command in a fresh shell must not hand that shell to the next holder.
    backend = await make_backend(min_sandboxes=1, max_sandboxes=1, slots_per_sandbox=1)
    for holder in ("first", "second", "third"):
        slot = await backend.acquire(holder)
        r = await bash(backend, slot, 'echo "${LEFT-unset}"; pwd; export LEFT=over; cd /tmp')
        assert r.output.splitlines() == ["unset", slot.workspace_dir], holder
        await backend.release(slot, reset_workspace=reset_workspace)


async def test_old_slot_object_is_useless_after_release(make_backend):
    backend = await make_backend(min_sandboxes=1, max_sandboxes=1, slots_per_sandbox=1)
    first = await backend.acquire("first")
    await backend.release(first)
    with pytest.raises(UsageError):
        await backend.release(first)
    second = await backend.acquire("second")
    # The place comes back (one slot); the lease id names one acquisition, never repeated.
    assert second.slot_id == first.slot_id and second.index == first.index
    assert uuid.UUID(first.lease_id) and uuid.UUID(second.lease_id) and first.lease_id != second.lease_id
    await bash(backend, second, "echo mine > f")
    r = await bash(backend, first, "cat f; echo intruder > f")
    assert not r.success
    assert (await bash(backend, second, "cat f")).output == "mine\n"


async def test_release_of_a_non_slot_raises(backend):
    with pytest.raises(UsageError):
        await backend.release("slot-0")


async def test_idle_sandboxes_scale_down_to_min(make_backend):
    backend = await make_backend(min_sandboxes=1, max_sandboxes=3, slots_per_sandbox=1,
                                 idle_timeout=0.5)
    slots = [await backend.acquire(f"t{i}") for i in range(3)]
    assert backend.get_status()["sandboxes"] == 3
    for s in slots:
        await backend.release(s)
    assert await settle(lambda: backend.get_status()["sandboxes"] == 1, timeout=5)
    await settle(lambda: len(agent_processes()) == 1, timeout=3)
    assert len(agent_processes()) == 1
    # It stays at the minimum, and what is left still works.
    await asyncio.sleep(1.0)
    assert backend.get_status()["sandboxes"] == 1
    slot = await backend.acquire("after")
    assert (await bash(backend, slot, "echo ok")).output == "ok\n"


async def test_a_slot_promised_to_a_waiting_acquire_keeps_its_sandbox(make_backend):
    # A new sandbox hands its slot to the waiting acquire, which leases it when it next
    # runs; on a loaded loop the idle reaper can run first. The reaper must not retire
    # the sandbox in that window (it did: 2 sandboxes with 3 slots held, under load).
    # The acquire's wake-up is held back here as long as the reaper needs to act.
    backend = await make_backend(min_sandboxes=1, max_sandboxes=2, slots_per_sandbox=1,
                                 idle_timeout=0.05)
    pool = backend._pools[backend.default_profile]
    held = await backend.acquire("held")
    waiter = asyncio.get_running_loop().create_future()
    pool._waiters.append(waiter)
    pool._grow()
    assert await settle(waiter.done, timeout=30)
    rec = waiter.result()
    await asyncio.sleep(0.5)  # ten idle limits: the reaper has run many times
    assert rec.sandbox.sandbox_id in pool._sandboxes and backend.get_status()["sandboxes"] == 2
    slot = pool._lease(rec, "late")
    assert (await bash(backend, slot, "echo served")).output == "served\n"
    # Released, the same sandbox is idle like any other and scales down to the minimum.
    await backend.release(slot)
    assert await settle(lambda: backend.get_status()["sandboxes"] == 1, timeout=5)
    assert (await bash(backend, held, "echo still")).output == "still\n"


async def test_held_sandboxes_are_not_scaled_down(make_backend):
    backend = await make_backend(min_sandboxes=0, max_sandboxes=2, slots_per_sandbox=1,
                                 idle_timeout=0.3)
    slot = await backend.acquire("busy")
    await asyncio.sleep(1.2)
    assert backend.get_status()["sandboxes"] == 1
    assert (await bash(backend, slot, "echo still-here")).output == "still-here\n"


# -- dead sandboxes --------------------------------------------------------------------

async def test_killed_agent_fails_its_calls_and_the_pool_recovers(make_backend):
    backend = await make_backend(min_sandboxes=1, max_sandboxes=1, slots_per_sandbox=2,
                                 acquire_timeout_s=10)
    a = await backend.acquire("a")
    b = await backend.acquire("b")
    agents = agent_processes()
    assert len(agents) == 1
    [agent_pid] = agents
    batch = asyncio.ensure_future(backend.execute_batch(
        [(a, "bash", {"command": "sleep 5"}), (b, "bash", {"command": "sleep 5"})]))
    await asyncio.sleep(0.5)
    os.kill(agent_pid, signal.SIGKILL)
    start = time.monotonic()
    results = await asyncio.wait_for(batch, 5)
    assert time.monotonic() - start < 2.5
    for r in results:
        assert not r.success
        assert "died" in r.error, r.error
        assert r.returncode is None and r.metadata["reason"] == "sandbox_died", r.metadata
    assert a.state is SlotState.ERROR
    status = pool_status(backend)
    assert status["sandboxes_died"] == 1
    assert status["healthy_sandboxes"] == status["sandboxes"] <= 1  # the dead one is not counted
    # Calls on the dead slots fail at once; releasing them is allowed.
    r = await bash(backend, a, "echo hi")
    assert not r.success and r.error
    await backend.release(a)
    await backend.release(b)
    # A dead sandbox does not count toward max_sandboxes=1: a replacement serves us.
    slot = await backend.acquire("after")
    assert slot.sandbox_id != a.sandbox_id
    assert (await bash(backend, slot, "echo recovered")).output == "recovered\n"
    assert backend.get_status()["sandboxes"] == 1


def _still_exiting(pid: int) -> str:
    """What a killed process is still doing (its state and kernel wait channel), if it is."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/wchan") as f:
            return f"agent {pid} still exiting: state {state}, in {f.read() or '?'}"
    except OSError:
        return f"agent {pid} gone"


async def test_killed_idle_agent_is_replaced_to_keep_the_minimum(make_backend):
    backend = await make_backend(min_sandboxes=1, max_sandboxes=1, slots_per_sandbox=1)
    [agent_pid] = agent_processes()
    os.kill(agent_pid, signal.SIGKILL)
    # The death is seen when the agent's stream closes, that is when the kernel has ended
    # the process: a thread in an uninterruptible call (a loop device's ioctl, a mount)
    # finishes it first, which took over 5 s once beside a second suite. The claim here is
    # the replacement, not how fast the kernel ends a process: a fail-safe bound of 30 s.
    died = await settle(lambda: pool_status(backend)["sandboxes_died"] == 1, timeout=30)
    assert died, (pool_status(backend), _still_exiting(agent_pid))
    assert await settle(lambda: backend.get_status()["available_slots"] == 1, timeout=30)
    assert agent_pid not in agent_processes()
    slot = await backend.acquire("t")
    assert (await bash(backend, slot, "echo fine")).output == "fine\n"


# -- stop ------------------------------------------------------------------------------

async def test_stop_leaves_nothing_behind(make_backend):
    backend = await make_backend(min_sandboxes=2, max_sandboxes=2, slots_per_sandbox=2)
    slots = [await backend.acquire(f"t{i}") for i in range(3)]
    await backend.execute_batch([(s, "bash", {"command": "sleep 60", "background": True})
                                 for s in slots])
    make_backend.note(backend)
    leftovers = make_backend.leftovers
    assert leftovers.processes() and leftovers.dirs()
    start = time.monotonic()
    await backend.stop()
    assert time.monotonic() - start < 10
    assert leftovers.dirs() == set()
    procs, _ = await leftovers.remaining(grace=1.0)
    assert procs == []
    assert agent_processes() == {}
    # Slots held at stop() are marked, and stop() again does nothing.
    assert all(s.state is SlotState.ERROR for s in slots)
    await backend.stop()


async def test_stop_while_commands_run(make_backend):
    backend = await make_backend(min_sandboxes=1, max_sandboxes=1, slots_per_sandbox=2)
    slot = await backend.acquire("t")
    call = asyncio.ensure_future(bash(backend, slot, "sleep 30", timeout=60))
    await asyncio.sleep(0.3)
    make_backend.note(backend)
    await asyncio.wait_for(backend.stop(), 10)
    r = await asyncio.wait_for(call, 5)
    assert not r.success
    procs, dirs = await make_backend.leftovers.remaining(grace=1.0)
    assert procs == [] and dirs == set()


async def test_use_after_stop_raises(make_backend):
    backend = await make_backend()
    slot = await backend.acquire("t")
    await backend.stop()
    with pytest.raises(BackendClosedError):
        await backend.acquire("t2")
    with pytest.raises(BackendClosedError):
        await backend.execute_batch([(slot, "bash", {"command": "true"})])
    with pytest.raises(BackendClosedError):
        await backend.start()
    with pytest.raises(BackendClosedError):
        await backend.read_artifact(slot, "x")
    assert backend.get_status()["closed"] is True


async def test_stop_fails_waiting_acquires(make_backend):
    backend = await make_backend(min_sandboxes=1, max_sandboxes=1, slots_per_sandbox=1,
                                 acquire_timeout_s=10)
    await backend.acquire("holder")
    waiter = asyncio.ensure_future(backend.acquire("waiter"))
    await asyncio.sleep(0.2)
    await backend.stop()
    with pytest.raises(BackendClosedError):
        await asyncio.wait_for(waiter, 3)


async def test_async_context_manager(make_backend):
    backend = await make_backend(start=False)
    async with backend as b:
        slot = await b.acquire("t")
        assert (await bash(b, slot, "echo ctx")).output == "ctx\n"
    assert b.get_status()["closed"] is True
    with pytest.raises(BackendClosedError):
        await b.acquire("t")


# -- cancellation ----------------------------------------------------------------------

async def test_cancelling_a_batch_kills_its_commands(make_backend):
    backend = await make_backend(min_sandboxes=1, max_sandboxes=1, slots_per_sandbox=2)
    slot = await backend.acquire("t")
    other = await backend.acquire("watcher")
    pause = f"30.{uuid.uuid4().int % 10**6:06d}"  # a sleep this test can tell apart on the host
    task = asyncio.ensure_future(backend.execute_batch(
        [(slot, "bash", {"command": f"echo start > started; sleep {pause}", "timeout": 60})]))
    # Cancel once the command runs (its sleep is visible from the host), not after a guess.
    sleeping = f"sleep\0{pause}\0".encode()
    assert await settle(lambda: any(p.cmdline == sleeping for p in processes().values()), timeout=30)
    task.cancel()
    start = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - start < 1
    # The other slot was not disturbed; the cancelled one is usable again at once,
    # ran its command exactly once, and has no sleep left running.
    assert (await bash(backend, other, "echo fine")).output == "fine\n"
    [r] = await asyncio.wait_for(backend.execute_batch(
        [(slot, "bash", {"command": "cat started; ps -eo args="})], timeout_s=5), 3)
    assert r.success, r.error
    assert r.output.startswith("start\n") and "sleep 30" not in r.output, r.output


async def test_cancelling_an_acquire_does_not_lose_the_slot(make_backend):
    backend = await make_backend(min_sandboxes=1, max_sandboxes=1, slots_per_sandbox=1,
                                 acquire_timeout_s=10)
    holder = await backend.acquire("holder")
    waiter = asyncio.ensure_future(backend.acquire("waiter"))
    await asyncio.sleep(0.2)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await backend.release(holder, reset_workspace=True)
    slot = await asyncio.wait_for(backend.acquire("next"), 3)
    assert slot.trajectory_id == "next"
    assert backend.get_status()["waiting_acquires"] == 0
