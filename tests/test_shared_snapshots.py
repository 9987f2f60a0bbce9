"""Slot snapshots and forks, once per driver: on Modal they work inside the sandbox's
container wherever its slots have a layered root (the local control plane's do), and
say why not otherwise."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from support import bash

from hermes_modal_tool import SnapshotError
from hermes_modal_tool.sandbox import SHELL_START_TIMEOUT_ENV

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


async def test_forks_while_spare_shells_start(driver_backend):
    """Round after round, forks land in slots whose next shell the agent is starting
    (a released slot gets one at once): every fork's first command runs, on the fork's
    own root, and none hangs."""
    backend = await driver_backend(slots_per_sandbox=4, max_sandboxes=1, acquire_timeout_s=30)
    parent = await backend.acquire("parent")
    r = await bash(backend, parent, "mkdir -p /workspace/s && cd /workspace/s && echo base > f && export K=v")
    assert r.success, r
    if backend.get_status()["pools"][backend.default_profile]["filesystem"] != "overlay":
        pytest.skip("this sandbox's slots have no layered root (no forks)")
    snap = await backend.snapshot(parent)
    releases: list[asyncio.Task] = []
    # Each step takes well under a second; 30 s catches a shell start stuck until the
    # agent's 60 s bound (as when a fork killed a starting shell's bwrap too early).
    for round_ in range(8):
        # The last round's forks are still being released (their shells restart) as
        # this round's forks take the same slots.
        forks = await asyncio.wait_for(backend.fork(snap, 3), 30)
        results = await asyncio.wait_for(asyncio.gather(*(
            bash(backend, f, f"pwd; echo $K; cat f; ls; echo r{round_}-{i} > mine")
            for i, f in enumerate(forks))), 30)
        for i, res in enumerate(results):
            assert res.success, (round_, i, res)
            assert res.output.split() == ["/workspace/s", "v", "base", "f"], (round_, i, res)
        releases = [asyncio.ensure_future(backend.release(f)) for f in forks]
        await asyncio.sleep(0.01 * round_)  # vary where the restart is when the fork comes
    await asyncio.wait_for(asyncio.gather(*releases), 30)
    await backend.release_snapshot(snap)
    assert (await bash(backend, parent, "ls")).output.split() == ["f"]


async def test_a_shell_that_cannot_start_fails_its_call_in_time(driver_backend, monkeypatch):
    """A shell that does not start (here bash never finishes reading its startup file:
    the profile's BASH_ENV blocks in slot 1, a real bash in a real sandbox) fails its
    call within the agent's bound (set low through the test-only knob) with an error
    naming the slot and what timed out; the call never hangs, other slots go on, the
    slot is reset and tried again."""
    monkeypatch.setenv(SHELL_START_TIMEOUT_ENV, "5")
    blocker = '$(read -r h </proc/sys/kernel/hostname; [ "$h" = slot-1 ] && sleep 600)'
    backend = await driver_backend(slots_per_sandbox=2, max_sandboxes=1, env_vars={"BASH_ENV": blocker})
    first = await backend.acquire("first")
    second = await backend.acquire("second")
    ok = await bash(backend, first, "echo fine")
    assert ok.success and ok.output == "fine\n", ok
    for attempt in range(2):
        started = time.monotonic()
        res = await asyncio.wait_for(bash(backend, second, "echo never", timeout=60), 30)
        took = time.monotonic() - started
        assert not res.success, res
        assert "slot 1: its shell did not start within 5s" in (res.error or ""), res
        assert "init lines" in res.error, res
        assert took < 20, (attempt, took, res)  # the bound (5 s) plus the host's own work
    assert (await bash(backend, first, "echo still fine")).output == "still fine\n"
    started = time.monotonic()
    await asyncio.wait_for(backend.release(second), 30)
    assert time.monotonic() - started < 15
    assert not backend.get_status()["pools"][backend.default_profile]["quarantined_slots"]



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
