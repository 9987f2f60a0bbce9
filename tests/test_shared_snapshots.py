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



async def test_snapshot_sandbox_makes_the_image_of_new_sandboxes(make_backend, modal_server):
    backend = await make_backend(driver="modal", slots_per_sandbox=2, min_sandboxes=1, max_sandboxes=2)
    first = backend.get_status()["pools"][backend.default_profile]
    image_id = await backend.snapshot_sandbox(
        setup=["mkdir -p /workspace/shared && echo prepared > /workspace/shared/marker"])
    assert image_id.startswith("im-")
    assert backend.profile().image == image_id
    [record] = [r for r in modal_server.sandboxes.values() if r.image_id == image_id] or [None]
    assert record is None  # no sandbox of that image yet: running ones keep theirs
    # a sandbox started now has the prepared files in the root its slots share
    a, b = await backend.acquire("a"), await backend.acquire("b")
    c = await backend.acquire("c")  # the first sandbox is full: a new one starts from the image
    assert c.sandbox_id != a.sandbox_id
    assert [r.image_id for r in modal_server.sandboxes.values() if r.status == "running"].count(image_id) == 1
    r = await bash(backend, c, "cat /workspace/shared/marker")
    assert r.output == "prepared\n", (r, first["filesystem"])
    with pytest.raises(Exception, match="exited 7"):
        await backend.snapshot_sandbox(setup=["echo broken; exit 7"])
    assert b.sandbox_id == a.sandbox_id
