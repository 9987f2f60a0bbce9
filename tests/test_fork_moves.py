"""A snapshot's move to another sandbox (the first fork there) is a task the backend
owns: stopping the backend meanwhile cancels it, the fork fails, nothing is left running."""

from __future__ import annotations

import asyncio
import os

import pytest
from support import bash

from hermes_modal_tool import SnapshotError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="snapshots need a layered root (root)")

MOVE_TASK = "hermes-modal-tool copy "


def moves() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith(MOVE_TASK) and not t.done()]


async def test_stop_cancels_a_snapshot_moving_to_another_sandbox(make_backend):
    backend = await make_backend(slots_per_sandbox=2, min_sandboxes=2, max_sandboxes=2,
                                 acquire_timeout_s=60, execution_timeout_s=60)
    parent = await backend.acquire("parent")
    # 48 MiB in 48 files: the tar stream to the other sandbox takes a while.
    r = await bash(backend, parent, "mkdir -p /workspace/big && cd /workspace/big && "
                   "for i in $(seq 48); do head -c 1048576 /dev/urandom > f$i; done; ls | wc -l")
    assert r.output == "48\n", r
    snap = await backend.snapshot(parent)
    fork = asyncio.ensure_future(backend.fork(snap, 2))  # one fork here, one in the other sandbox
    for _ in range(600):
        if moves() or fork.done():
            break
        await asyncio.sleep(0.005)
    assert moves(), "the snapshot never started moving to the other sandbox"
    await asyncio.wait_for(backend.stop(), 60)
    assert not moves()
    with pytest.raises((SnapshotError, asyncio.CancelledError)):  # the sandboxes stopped under it
        await asyncio.wait_for(fork, 30)
