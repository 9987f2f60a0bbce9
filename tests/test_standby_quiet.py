"""Standby layers wait for a free CPU (agent/limits/quiet.py), and are all made once it is.

Slots started at once: while their shells start, the agent puts off the next tenants'
standby layers (none is made before the last of those shells' roots); once the starts
are done (and the machine's CPU pressure is low, or the wait's budget is spent) every
used slot has one.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from support import bash, layered

from hermes_modal_tool.agent.limits import quiet

pytestmark = pytest.mark.usefixtures("needs_root")


@pytest.fixture
def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("slots of their own uid and root need the backend to run as root")


def _layers(state, i):
    return sorted(n for n in os.listdir(state / "fs" / f"slot_{i}") if n.startswith("layer-"))


async def test_slots_started_at_once_all_get_a_standby_layer(make_backend):
    n = 8  # twice the shells a sandbox starts at once: the later ones wait
    backend = await make_backend(slots_per_sandbox=n, min_sandboxes=1, max_sandboxes=1)
    if not layered(backend):
        pytest.skip("no layered root here")
    pool = next(iter(backend._pools.values()))
    [sandbox] = pool._sandboxes.values()
    state = next(d for d in backend._drivers.values()).state_root / sandbox.sandbox_id
    slots = [await backend.acquire(f"t{i}") for i in range(n)]
    started = time.time()
    results = await backend.execute_batch(
        [(s, "bash", {"command": "echo hi > /etc/mine; echo $HOSTNAME"}) for s in slots])
    assert [r.output for r in results] == [f"slot-{s.index}\n" for s in slots], results
    loop = asyncio.get_running_loop()
    deadline = loop.time() + quiet.BUDGET_S + 20
    while loop.time() < deadline:
        layers = {s.index: _layers(state, s.index) for s in slots}
        if all(len(v) == 2 for v in layers.values()):
            break
        await asyncio.sleep(0.1)
    assert all(len(v) == 2 for v in layers.values()), layers  # in use, and the standby
    # Put off while shells were starting: no standby made in the batch (for a slot whose
    # shell started in it) is older than the last layer in use made in it.
    made = {i: [os.stat(state / "fs" / f"slot_{i}" / name).st_mtime for name in v] for i, v in layers.items()}
    in_batch = [m for m in made.values() if m[0] >= started]
    assert len(in_batch) >= n // 2, made  # most shells start in the batch, not ahead of it
    last_root = max(m[0] for m in in_batch)
    assert all(m[1] >= last_root for m in in_batch), (last_root, made)
    for s in slots:
        await backend.release(s, reset_workspace=True)
    again = [await backend.acquire(f"u{i}") for i in range(n)]
    for s in again:  # nothing of the last tenant
        r = await bash(backend, s, "cat /etc/mine 2>/dev/null || echo clean")
        assert r.output == "clean\n", (s.index, r.output)
