"""Slot snapshots and forks, once per driver: on Modal they work inside the sandbox's
container wherever its slots have a layered root (the local control plane's do), and
say why not otherwise."""

from __future__ import annotations

import os

import pytest
from support import bash

from hermes_modal_tool import SnapshotError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="layered roots need root")


async def test_fork_within_a_sandbox_of_either_driver(driver_backend):
    backend = await driver_backend(slots_per_sandbox=4, max_sandboxes=1)
    parent = await backend.acquire("parent")
    r = await bash(backend, parent, "mkdir -p /workspace/s && cd /workspace/s && echo base > f && export K=v")
    assert r.success, r
    pool = backend.get_status()["pools"][backend.default_profile]
    if pool["filesystem"] != "overlay":
        with pytest.raises(SnapshotError, match="workspace-only"):
            await backend.snapshot(parent)
        return
    a, b = await backend.fork(parent, 2)
    ra = await bash(backend, a, "pwd; echo $K; cat f; echo a > f; cat f")
    rb = await bash(backend, b, "cat f")
    assert ra.output.split() == ["/workspace/s", "v", "base", "a"], ra
    assert rb.output == "base\n"
    assert (await bash(backend, parent, "cat f")).output == "base\n"

