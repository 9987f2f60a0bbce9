"""Faults in the middle of a batch: kill -9 a slot's shell, a sandbox's agent, a whole
sandbox (agent and every bwrap); stop the backend with calls in flight; cancel the task
awaiting ``execute_batch``.

Each time: every affected call comes back as a failed ExecutionResult quickly (measured;
bound ``FAIL_FAST_S``) with an error that says what happened; calls in unaffected slots
finish normally; the pool replaces what died; and (the ``faulty`` fixture) nothing the
backend created is left after ``stop()``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from support import bash, settle

from hermes_modal_tool import BackendClosedError, SlotState

from .faultkit import (
    FAIL_FAST_S,
    Footprint,
    descendants,
    kill,
    procs,
    timed_batch,
    wait_for_processes,
)

LONG = "echo started-{tag}; sleep 30; echo finished-{tag}"


def long_call(slot, tag: str) -> tuple:
    return (slot, "bash", {"command": LONG.format(tag=tag), "timeout": 60})


def short_call(slot, tag: str, sleep: float = 1.5) -> tuple:
    return (slot, "bash", {"command": f"sleep {sleep}; echo ok-{tag} $HOSTNAME"})


def pool_status(backend) -> dict:
    return backend.get_status()["pools"][backend.default_profile]


async def six_slots(backend):
    """Six held slots: ``{sandbox_id: [slots]}`` with two sandboxes of three."""
    slots = [await backend.acquire(f"traj-{i}") for i in range(6)]
    by: dict[str, list] = {}
    for s in slots:
        by.setdefault(s.sandbox_id, []).append(s)
    assert sorted(map(len, by.values())) == [3, 3], by
    # Start every shell and give each workspace a file to find again.
    rs = await backend.execute_batch([(s, "bash", {"command": f"echo {s.trajectory_id} > owner"})
                                      for s in slots])
    assert all(r.success for r in rs), rs
    return by


def check_bystanders(results, slots, tag_of) -> None:
    for s, r in zip(slots, results, strict=True):
        assert r.success, (s.slot_id, r.error)
        assert r.output == f"ok-{tag_of(s)} slot-{s.index}\n", (s.slot_id, r.output)


def sleepers(fp: Footprint) -> list[int]:
    return [p.pid for p in fp.processes() if p.cmdline == b"sleep\x0030\x00"]


# -- a slot's shell ------------------------------------------------------------------------

async def test_killed_shell_fails_only_its_own_call(faulty):
    backend, fp = await faulty()
    by = await six_slots(backend)
    (sid_a, in_a), (_, in_b) = sorted(by.items())
    victim, neighbours = in_a[0], in_a[1:]
    bystanders = neighbours + in_b
    victim_task = asyncio.ensure_future(timed_batch(backend, [
        long_call(victim, "v"),
        # queued behind the long call in the same slot: runs in a fresh shell
        (victim, "bash", {"command": "echo queued; cat owner; echo $HOSTNAME"}),
    ]))
    others_task = asyncio.ensure_future(timed_batch(
        backend, [short_call(s, s.trajectory_id, 2.5) for s in bystanders]))
    await wait_for_processes(fp, [victim] + bystanders)
    shell = fp.slot_shell(victim)
    assert shell is not None
    killed_at = time.monotonic()
    assert kill(shell)

    (r_killed, r_next), done_at = await asyncio.wait_for(victim_task, 15)
    took = done_at - killed_at
    assert not r_killed.success
    assert "shell was killed by signal 9" in r_killed.error, r_killed.error
    assert r_killed.metadata["returncode"] == 137
    assert r_killed.output == "started-v\n"  # what it printed before the kill is kept
    assert took < FAIL_FAST_S, f"the killed call took {took:.2f}s to fail"
    # The slot recovers: the queued call ran in a fresh shell, same workspace.
    assert r_next.success, r_next.error
    assert r_next.output == f"queued\n{victim.trajectory_id}\nslot-{victim.index}\n"

    results, _ = await asyncio.wait_for(others_task, 15)
    check_bystanders(results, bystanders, lambda s: s.trajectory_id)
    # Nothing was replaced: a shell is not a sandbox.
    status = pool_status(backend)
    assert status["sandboxes_died"] == 0 and status["healthy_sandboxes"] == 2
    assert victim.state is SlotState.ACQUIRED
    assert sid_a in fp.agents()
    assert not sleepers(fp), "the killed shell's sleep is still running"
    r = await bash(backend, victim, "echo again $HOSTNAME; cat owner")
    assert r.output == f"again slot-{victim.index}\n{victim.trajectory_id}\n", r


async def test_killed_idle_shell_is_restarted_on_next_call(faulty):
    backend, fp = await faulty()
    by = await six_slots(backend)
    victim = next(iter(by.values()))[0]
    assert await bash(backend, victim, "cd /tmp && export KEEP=1")
    shell = fp.slot_shell(victim)
    assert fp.slot_bwraps(victim), "the slot's bwraps are found"
    assert kill(shell)
    # Dead once its whole sandbox is: until its bwraps exit they hold the shell's output
    # pipe open, and a command written meanwhile reports that the shell exited.
    await settle(lambda: fp.slot_shell(victim) is None and not fp.slot_bwraps(victim))
    r = await bash(backend, victim, "echo $HOSTNAME; cat owner")
    assert r.success, r.error
    assert r.output == f"slot-{victim.index}\n{victim.trajectory_id}\n"
    assert fp.slot_shell(victim) not in (None, shell)
    assert pool_status(backend)["sandboxes_died"] == 0


# -- a sandbox's agent, or the whole sandbox --------------------------------------------------

@pytest.mark.parametrize("what", ["agent", "sandbox"])
async def test_killed_sandbox_fails_its_calls_and_is_replaced(faulty, what):
    backend, fp = await faulty()
    by = await six_slots(backend)
    (sid_a, in_a), (sid_b, in_b) = sorted(by.items())
    agent = fp.agents()[sid_a]
    victim_task = asyncio.ensure_future(timed_batch(backend, [
        long_call(in_a[0], "a0"), long_call(in_a[0], "a0-queued"),
        long_call(in_a[1], "a1"), long_call(in_a[2], "a2"),
    ]))
    others_task = asyncio.ensure_future(timed_batch(
        backend, [short_call(s, s.trajectory_id, 2.5) for s in in_b]))
    await wait_for_processes(fp, in_a + in_b)
    tree = fp.sandbox_tree(sid_a)
    table = procs()
    if what == "agent":
        targets = [agent]
    else:  # the agent and every bwrap of the sandbox, at once
        targets = [agent] + [p for p in tree if p in table and table[p].comm == "bwrap"]
        assert len(targets) >= 1 + 2 * 3  # outer bwrap + its pid-1 per slot
    killed_at = time.monotonic()
    for pid in targets:
        kill(pid)

    results, done_at = await asyncio.wait_for(victim_task, 15)
    took = done_at - killed_at
    for r in results:
        assert not r.success
        assert f"sandbox {sid_a} died: " in r.error, r.error
        # The reason: the agent's exit status when it is known already, else the closed
        # stream (the agent closes its pipe a moment before it can be waited for).
        assert (f"agent process {agent} was killed by signal 9" in r.error
                or r.error.endswith("the agent closed its stream")), r.error
    assert took < FAIL_FAST_S, f"the calls of the killed sandbox took {took:.2f}s to fail"
    # The other sandbox never noticed.
    results, _ = await asyncio.wait_for(others_task, 15)
    check_bystanders(results, in_b, lambda s: s.trajectory_id)
    # Every process of the dead sandbox is gone.
    assert await settle(lambda: not set(tree) & set(procs()), timeout=5), \
        [procs()[p] for p in set(tree) & set(procs())]
    # Its slots are marked; calls on them fail at once, saying why; release is allowed.
    for s in in_a:
        assert s.state is SlotState.ERROR and "died" in (s.error or "")
        r = await bash(backend, s, "echo hi")
        assert not r.success and "died" in r.error, r.error
        await backend.release(s)
    # The pool replaces it (max_sandboxes=2: the dead one does not count).
    await settle(lambda: pool_status(backend)["healthy_sandboxes"] == 2, timeout=10)
    status = pool_status(backend)
    assert status["sandboxes_died"] == 1
    assert status["sandboxes"] == status["healthy_sandboxes"] == 2, status
    fresh = [await backend.acquire(f"new-{i}") for i in range(3)]
    assert all(s.sandbox_id not in (sid_a, sid_b) for s in fresh)
    rs = await backend.execute_batch([(s, "bash", {"command": "ls -A; echo $HOSTNAME"})
                                      for s in fresh])
    assert [r.output for r in rs] == [f"slot-{s.index}\n" for s in fresh]
    # The surviving sandbox's slots still work.
    rs = await backend.execute_batch([(s, "bash", {"command": "cat owner"}) for s in in_b])
    assert [r.output for r in rs] == [f"{s.trajectory_id}\n" for s in in_b]
    # The dead sandbox's state directory and cgroups are removed (without waiting for stop()).
    assert await settle(lambda: not any(sid_a in d for d in _state_entries(fp)), timeout=5)
    assert await settle(lambda: not fp.cgroups_of(sid_a), timeout=5), fp.cgroups_of(sid_a)


def _state_entries(fp: Footprint) -> list[str]:
    try:
        return os.listdir(fp.state_root)
    except OSError:
        return []


# -- stop() with calls in flight -----------------------------------------------------------

async def test_stop_with_calls_in_flight(faulty):
    backend, fp = await faulty()
    by = await six_slots(backend)
    slots = [s for ss in by.values() for s in ss]
    batch = asyncio.ensure_future(timed_batch(
        backend, [long_call(s, s.trajectory_id) for s in slots] + [long_call(slots[0], "queued")]))
    waiter = asyncio.ensure_future(backend.acquire("waiting"))  # every slot is held
    await wait_for_processes(fp, slots)
    assert not waiter.done()
    before = fp.count()
    assert before["processes"] and before["dirs"], before
    if pool_status(backend)["limits"] in ("cgroup-v1", "cgroup-v2"):
        assert before["cgroups"], before
    stop_at = time.monotonic()
    stopper = asyncio.ensure_future(backend.stop())
    results, done_at = await asyncio.wait_for(batch, 15)
    took = done_at - stop_at
    for r in results:
        assert not r.success
        assert "stop" in r.error, f"the error does not say the backend stopped: {r.error!r}"
    assert took < FAIL_FAST_S, f"in-flight calls took {took:.2f}s to fail after stop()"
    with pytest.raises(BackendClosedError):
        await asyncio.wait_for(waiter, 5)
    await asyncio.wait_for(stopper, 15)
    stop_took = time.monotonic() - stop_at
    assert stop_took < 10, stop_took
    after = await fp.settled_count()
    assert not any(after.values()), after
    with pytest.raises(BackendClosedError):
        await backend.execute_batch([(slots[0], "bash", {"command": "true"})])


# -- cancelling the caller ---------------------------------------------------------------------

@pytest.mark.parametrize("how", ["cancel", "wait_for"])
async def test_cancelled_batch_kills_its_calls_only(faulty, how):
    backend, fp = await faulty()
    by = await six_slots(backend)
    (_, in_a), (_, in_b) = sorted(by.items())
    victims = [in_a[0], in_a[1], in_b[0]]
    bystanders = [in_a[2], in_b[1], in_b[2]]
    requests = [(s, "bash", {"command": "echo run >> runs; sleep 30", "timeout": 60})
                for s in victims]
    requests.append((victims[0], "bash", {"command": "echo queued > queued"}))
    others_task = asyncio.ensure_future(timed_batch(
        backend, [short_call(s, s.trajectory_id, 2.5) for s in bystanders]))
    if how == "cancel":
        task = asyncio.ensure_future(backend.execute_batch(requests))
        await wait_for_processes(fp, victims)
        cancelled_at = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        cancelled_at = None

        async def caller():
            nonlocal cancelled_at
            try:
                await backend.execute_batch(requests)
            finally:
                cancelled_at = cancelled_at or time.monotonic()

        waiting = asyncio.ensure_future(asyncio.wait_for(caller(), 1.0))
        await wait_for_processes(fp, victims)
        with pytest.raises(asyncio.TimeoutError):
            await waiting
    took = time.monotonic() - cancelled_at
    assert took < 1.0, f"cancellation took {took:.2f}s"
    # The cancelled calls' processes are killed, quickly.
    assert await settle(lambda: not sleepers(fp), timeout=FAIL_FAST_S), sleepers(fp)
    # Bystanders finish normally; the victim slots are usable at once, ran their
    # command exactly once, and the queued call never ran.
    results, _ = await asyncio.wait_for(others_task, 15)
    check_bystanders(results, bystanders, lambda s: s.trajectory_id)
    rs = await asyncio.wait_for(backend.execute_batch(
        [(s, "bash", {"command": "cat runs; ls queued 2>&1; echo $HOSTNAME"}) for s in victims],
        timeout_s=10), 5)
    for s, r in zip(victims, rs, strict=True):
        assert r.output.startswith("run\n") and r.output.count("run\n") == 1, r.output
        assert "No such file" in r.output and r.output.endswith(f"slot-{s.index}\n"), r.output
    status = pool_status(backend)
    assert status["sandboxes_died"] == 0 and status["healthy_sandboxes"] == 2


# -- several faults in a row ---------------------------------------------------------------------

async def test_repeated_faults_never_misroute_a_result(faulty):
    """Rounds of mixed faults while every slot keeps running calls: each result is either
    right (names its slot and round) or a failure that says what happened."""
    backend, fp = await faulty(acquire_timeout_s=20.0)
    held = [await backend.acquire(f"r-{i}") for i in range(6)]
    seen_errors: list[str] = []
    for rnd in range(3):
        reqs = [(s, "bash", {"command": f"echo R{rnd}-{s.trajectory_id} $HOSTNAME; sleep 3",
                             "timeout": 60}) for s in held]
        task = asyncio.ensure_future(timed_batch(backend, reqs))
        await wait_for_processes(fp, held)
        table = procs()
        if rnd == 0:  # a shell
            kill(fp.slot_shell(held[0], table))
        elif rnd == 1:  # an agent
            kill(fp.agents(table)[held[1].sandbox_id])
        else:  # a slot's whole bwrap tree (outer bwrap first)
            shell = fp.slot_shell(held[2], table)
            outer = table[table[shell].ppid].ppid
            for pid in [outer] + descendants(outer, table):
                kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results, done_at = await asyncio.wait_for(task, 20)
        for s, r in zip(held, results, strict=True):
            want = f"R{rnd}-{s.trajectory_id} slot-{s.index}\n"
            if r.success:
                assert r.output == want, (s.slot_id, r.output)
            else:
                assert ("died" in r.error or "killed" in r.error), r.error
                assert r.output in ("", want), (s.slot_id, r.output)
                seen_errors.append(r.error)
        assert any(not r.success for r in results)
        assert done_at - killed_at < 3 + FAIL_FAST_S
        # Replace dead slots with fresh ones.
        for i, s in enumerate(held):
            if s.state is SlotState.ERROR:
                await backend.release(s)
                held[i] = await backend.acquire(f"r{rnd}-{i}")
    assert len(seen_errors) >= 3
    status = pool_status(backend)
    assert status["sandboxes_died"] == 1
    await settle(lambda: pool_status(backend)["healthy_sandboxes"] == 2, timeout=10)
