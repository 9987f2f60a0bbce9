"""Shared setup keyed by content: one run per key, however many slots ask at once; a
failed setup fails every waiter with its output and is not cached."""

from __future__ import annotations

import asyncio
import os

import pytest
from support import bash

from hermes_modal_tool import SetupError, UsageError

pytestmark = pytest.mark.usefixtures("needs_root")


@pytest.fixture
def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("shared setup forks from snapshots: a layered root (the backend must run as root)")


SETUP = ["mkdir -p /workspace && cd /workspace && date +%s%N > stamp && echo ran >> /root/runs",
         "export READY=yes"]


async def test_sixteen_concurrent_requests_run_the_setup_once(make_backend):
    backend = await make_backend(slots_per_sandbox=17, max_sandboxes=1, acquire_timeout_s=60)
    slots = await asyncio.gather(*(backend.acquire(f"t{i}", setup=SETUP) for i in range(16)))
    results = await backend.execute_batch(
        [(s, "bash", {"command": "pwd; cat stamp; cat /root/runs; echo $READY"}) for s in slots])
    outputs = {r.output for r in results}
    assert len(outputs) == 1, outputs  # the same stamp everywhere: one run
    pwd, _stamp, runs, ready = outputs.pop().split()
    assert (pwd, runs, ready) == ("/workspace", "ran", "yes")
    [entry] = backend.get_status()["setups"].values()
    assert entry["runs"] == 1 and entry["failures"] == 0
    # a later request reuses it at once
    again = await backend.acquire("late", setup=SETUP)
    assert (await bash(backend, again, "cat stamp")).output.strip() == _stamp
    assert [e["runs"] for e in backend.get_status()["setups"].values()] == [1]


async def test_two_keys_run_twice(make_backend):
    backend = await make_backend(slots_per_sandbox=9, max_sandboxes=1, acquire_timeout_s=60)
    other = [SETUP[0] + " && echo other > kind"]
    slots = await asyncio.gather(*(backend.acquire(f"t{i}", setup=SETUP if i % 2 else other)
                                   for i in range(8)))
    kinds = await backend.execute_batch([(s, "bash", {"command": "cat kind 2>/dev/null || echo base"})
                                         for s in slots])
    assert [k.output.strip() for k in kinds] == ["other", "base"] * 4
    assert sorted(e["runs"] for e in backend.get_status()["setups"].values()) == [1, 1]


async def test_profile_setup_applies_to_every_acquire(make_backend):
    backend = await make_backend(slots_per_sandbox=3, max_sandboxes=1, setup=["echo from-profile > /etc/marker"])
    a, b = await backend.acquire("a"), await backend.acquire("b")
    for s in (a, b):
        assert (await bash(backend, s, "cat /etc/marker")).output == "from-profile\n"


async def test_failing_setup_fails_every_waiter_with_its_output_and_is_not_cached(make_backend):
    backend = await make_backend(slots_per_sandbox=4, max_sandboxes=1, acquire_timeout_s=30)
    bad = ["echo preparing; echo oops >&2; exit 3"]
    got = await asyncio.gather(*(backend.acquire(f"t{i}", setup=bad) for i in range(3)),
                               return_exceptions=True)
    assert all(isinstance(g, SetupError) for g in got), got
    assert got[0] is got[1] is got[2]  # one run, one failure for all
    assert "preparing" in got[0].output and "oops" in got[0].output and got[0].returncode == 3
    assert "exit 3" in str(got[0])
    with pytest.raises(SetupError):
        await backend.acquire("again", setup=bad)
    [entry] = backend.get_status()["setups"].values()
    assert entry["runs"] == 2 and entry["failures"] == 2
    # the slots went back: all free again
    for _ in range(100):
        if backend.get_status()["available_slots"] == 4:
            break
        await asyncio.sleep(0.05)
    assert backend.get_status()["available_slots"] == 4
    with pytest.raises(UsageError, match="setup must be"):
        await backend.acquire("x", setup=[""])
