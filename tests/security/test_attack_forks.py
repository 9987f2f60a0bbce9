"""The filesystem and process attacks again, with every slot a fork of a snapshot.

The attack functions are imported from their modules and collected here again; this
module's ``slot`` and ``two_slots`` fixtures (which win over the suite's) make each slot
a fork: the victim and the attacker start from one frozen layer, so anything shared
through it (the frozen files, the idmapped lowers, the read-only overlay joining them)
is under attack too.
"""

from __future__ import annotations

import os

import pytest
from support import bash

from .test_attack_filesystem import *  # noqa: F403 - collected here again, on forks
from .test_attack_processes import *  # noqa: F403

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="forks need a layered root (run as root)")

BASE = "echo base > /root/base.txt; mkdir -p /workspace && echo shared > /workspace/shared.txt"


async def _forks(backend, names):
    base = await backend.acquire("base")
    assert (await bash(backend, base, BASE)).success
    snap = await backend.snapshot(base)
    await backend.release(base, reset_workspace=True)
    slots = await backend.fork(snap, len(names), list(names))
    await backend.release_snapshot(snap)  # the forks hold it
    return slots


@pytest.fixture
async def slot(backend):
    [s] = await _forks(backend, ["traj-test"])
    return s


@pytest.fixture
async def two_slots(backend):
    a, b = await _forks(backend, ["victim", "attacker"])
    assert a.sandbox_id == b.sandbox_id and a.workspace_dir != b.workspace_dir
    r = await bash(backend, a, f"cd {a.workspace_dir}; echo victim-secret > secret.txt; "
                               "mkdir d; echo x > d/f; cat /root/base.txt")
    assert r.success and "base" in r.output, r
    return a, b
