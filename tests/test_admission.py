"""Admission: a sandbox whose CPU is taken queues further commands before their timeout
clock starts; commands that only wait (``sleep``) make room for others; the host keeps
waiting for a call that waits to start."""

from __future__ import annotations

import asyncio
import time

from support import bash

from hermes_modal_tool import _pool_calls as pool_module

HOG = "python3 -c 'while True: pass'"


async def _warm(backend, slots):
    """Start every slot's shell, so the timings below are about commands only."""
    assert all(r.success for r in await backend.execute_batch([(s, "bash", {"command": "true"})
                                                               for s in slots]))


async def test_queued_commands_do_not_time_out_while_they_wait(make_backend):
    # cpu=1.0: four commands that compute fill the sandbox; the next ones wait for their turn
    # (here until the hogs have used their head start, 1 s of CPU each, or timed out), then
    # run with their whole timeout.
    backend = await make_backend(cpu=1.0, slots_per_sandbox=10, min_sandboxes=1, max_sandboxes=1)
    slots = [await backend.acquire(f"t{i}") for i in range(10)]
    await _warm(backend, slots)
    hogs = asyncio.ensure_future(backend.execute_batch(
        [(s, "bash", {"command": HOG, "timeout": 3}) for s in slots[:4]]))
    await asyncio.sleep(0.5)
    start = time.monotonic()
    waited = await backend.execute_batch(
        [(s, "bash", {"command": "echo started", "timeout": 0.5}) for s in slots[4:]])
    took = time.monotonic() - start
    assert [(r.success, r.output) for r in waited] == [(True, "started\n")] * 6, waited
    assert all(r.metadata["duration_s"] < 0.5 for r in waited), waited
    assert took > 1.0, f"the calls did not wait for the hogs ({took:.2f}s)"
    assert [r.returncode for r in await hogs] == [124] * 4


async def test_commands_that_sleep_do_not_hold_the_queue(make_backend):
    # Eight sleepers would fill the sandbox (cpu=1.0: four computing commands do) if they
    # counted: a command arriving after them would wait until they end.
    backend = await make_backend(cpu=1.0, slots_per_sandbox=9, min_sandboxes=1, max_sandboxes=1)
    slots = [await backend.acquire(f"t{i}") for i in range(9)]
    await _warm(backend, slots)
    start = time.monotonic()
    sleepers = asyncio.ensure_future(backend.execute_batch(
        [(s, "bash", {"command": "sleep 3; echo slept"}) for s in slots[:8]]))
    await asyncio.sleep(0.2)
    late = time.monotonic()
    result = await bash(backend, slots[8], "echo late", timeout=5)
    waited = time.monotonic() - late
    assert (result.success, result.output) == (True, "late\n"), result
    assert waited < 1.0, f"a command waited {waited:.2f}s behind sleeping ones"
    assert [r.output for r in await sleepers] == ["slept\n"] * 8
    assert time.monotonic() - start < 5, "the sleepers did not overlap"


async def test_the_host_waits_for_a_call_queued_behind_a_long_one(make_backend, monkeypatch):
    # The host gives a call its timeout plus a grace period (30 s; 1 s here) to answer. A call
    # queued behind a longer one in its slot is reported queued, then started, so that wait
    # does not count against it.
    monkeypatch.setattr(pool_module, "HOST_GRACE_S", 1.0)
    backend = await make_backend()
    slot = await backend.acquire("t")
    long, short = await backend.execute_batch([
        (slot, "bash", {"command": "sleep 3; echo long", "timeout": 10}),
        (slot, "bash", {"command": "echo short", "timeout": 1}),
    ])
    assert (long.success, long.output) == (True, "long\n"), long
    assert (short.success, short.output) == (True, "short\n"), short


async def test_a_batch_queued_behind_another_batch_is_not_given_up(make_backend, monkeypatch):
    # A batch's calls to one sandbox share one deadline (_call_group.py), the longest wait of
    # its calls (timeout + grace; 1 + 1 s here): a batch whose only call waits 3 s behind
    # another batch's call in its slot is reported queued, which stops that deadline, and
    # started, which gives it back whole. Without that rule it fails at 2 s, "did not answer".
    monkeypatch.setattr(pool_module, "HOST_GRACE_S", 1.0)
    backend = await make_backend()
    slot = await backend.acquire("t")
    first = asyncio.ensure_future(backend.execute_batch(
        [(slot, "bash", {"command": "sleep 3; echo long", "timeout": 10})]))
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    [short] = await backend.execute_batch([(slot, "bash", {"command": "echo short", "timeout": 1})])
    assert (short.success, short.output) == (True, "short\n"), short
    assert time.monotonic() - t0 > 2.0, "the second batch did not wait behind the first"
    [long] = await first
    assert (long.success, long.output) == (True, "long\n"), long
