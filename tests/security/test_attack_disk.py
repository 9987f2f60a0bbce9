"""Attacks on ``slot_disk`` (issue 35, class 5): the limit holds by the kernel, not a watch.

Each slot's writable layer is a file system of its own of ``slot_disk`` MiB and a fixed
inode count (agent/fs/slotdisk.py). The verdicts are taken on the host's side of the slot:
the layer's own file system, seen through the agent's mount namespace
(``/proc/AGENT/root``), and its usage as the kernel counts it (``statvfs``: files deleted
but still open count too). Each attack has a positive control beside it (a write below
the limit succeeds; the space comes back).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from support import SMALL, bash

from .helpers import agent_view

LIMIT_MIB = 64
MIB = 1024 * 1024

pytestmark = pytest.mark.usefixtures("needs_root")


@pytest.fixture
def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("a layered root (and its own file system) needs the backend to run as root")


async def disk_backend(make_backend, **fields):
    backend = await make_backend(**{**SMALL, "slot_disk": LIMIT_MIB, **fields})
    disk = backend.get_status()["pools"][backend.default_profile]["caps"]["disk"]
    assert disk["mib"] == fields.get("slot_disk", LIMIT_MIB), disk
    return backend, disk


async def layer_path(backend, slot) -> Path:
    """The slot's root (its overlay) as the agent sees it, reached on the host through the
    agent's mount namespace. ``statvfs`` of an overlay is its upper layer's file system's:
    asserts that is a file system of its own, of ``slot_disk`` MiB (not the host's disk)."""
    assert (await bash(backend, slot, "true")).success  # its layer is mounted by now
    state = Path(backend.get_status()["drivers"]["local"]["state_root"]) / slot.sandbox_id
    base = state / "fs" / f"slot_{slot.index}"
    for _ in range(50):  # ``current`` is pointed in the background (agent/main.py layer_work)
        if (base / "current").is_symlink():
            break
        await asyncio.sleep(0.05)
    merged = base / os.readlink(base / "current") / "merged"
    disk = backend.get_status()["pools"][backend.default_profile]["caps"]["disk"]
    path = agent_view(merged)
    st = os.statvfs(path)
    assert st.f_blocks * st.f_frsize <= disk["mib"] * MIB, (
        f"the slot's layer is on a file system of {st.f_blocks * st.f_frsize // MIB} MiB, "
        f"not one of its own of {disk['mib']} MiB")
    return path


def used(path: Path) -> tuple[int, int]:
    """``(bytes, inodes)`` in use on the file system at ``path``, as the kernel counts them."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree


async def test_status_says_the_kernel_enforces_it_and_the_layer_is_that_size(make_backend):
    backend, disk = await disk_backend(make_backend)
    assert disk["enforced"].startswith("kernel") and disk["default"] is False, disk
    assert disk["inodes"] == LIMIT_MIB * MIB // 8192, disk
    slot = await backend.acquire("t")
    assert (await bash(backend, slot, "echo hi > /tmp/x")).success
    st = os.statvfs(await layer_path(backend, slot))
    assert st.f_blocks * st.f_frsize <= LIMIT_MIB * MIB and st.f_files == disk["inodes"], st


async def test_a_setsid_writer_left_running_after_its_command_returned_gets_enospc(make_backend):
    """Issue 35: a ``setsid`` writer kept writing after its command returned (the idle slot
    was not watched) until the layer held 360 MiB over a 64 MiB limit."""
    backend, _ = await disk_backend(make_backend)
    slot = await backend.acquire("writer")
    control = await bash(backend, slot, "head -c 16M /dev/zero > /var/tmp/small && echo ok")
    assert control.output == "ok\n", (control.output, control.error)  # below the limit: fine
    writer = ("for i in $(seq 200); do head -c 1M /dev/zero > /var/tmp/w$i 2>/dev/null || "
              "{ rm -f /var/tmp/w$i; echo stopped-at $i > /var/tmp/done; exit; }; done; "
              "echo all > /var/tmp/done")
    r = await bash(backend, slot, f"setsid sh -c 'sleep 0.3; {writer}' </dev/null >/dev/null 2>&1 & echo started")
    assert r.output == "started\n", (r.output, r.error)
    done = ""
    for _ in range(150):  # the slot is idle meanwhile: no command of it runs
        await asyncio.sleep(0.2)
        done = (await bash(backend, slot, "cat /var/tmp/done 2>/dev/null")).output
        if done:
            break
    assert done.startswith("stopped-at"), done
    assert 40 <= int(done.split()[1]) <= LIMIT_MIB - 16 + 1, done  # about the limit, 16 MiB held
    assert used(await layer_path(backend, slot))[0] <= LIMIT_MIB * MIB


async def test_deleted_but_open_files_count_and_fail_at_the_limit(make_backend):
    """Issue 35: a command held 480 MiB in deleted-but-open files and finished without an
    error. The shell keeps the descriptor open after the command, so the space stays held."""
    backend, _ = await disk_backend(make_backend)
    slot = await backend.acquire("holder")
    layer = await layer_path(backend, slot)
    before = used(layer)[0]
    r = await bash(backend, slot, "exec 3>/tmp/held; rm /tmp/held; head -c 16M /dev/zero >&3; echo rc=$?")
    assert "rc=0" in r.output, r.output  # positive control: below the limit
    assert used(layer)[0] - before >= 16 * MIB  # counted although no name holds it
    r = await bash(backend, slot, "head -c 480M /dev/zero >&3; echo rc=$?", timeout=30)
    assert "No space left on device" in r.output and "rc=1" in r.output, (r.output, r.error)
    assert used(layer)[0] <= LIMIT_MIB * MIB
    r = await bash(backend, slot, "exec 3>&-; head -c 32M /dev/zero > /tmp/after && echo ok")
    assert r.output == "ok\n", (r.output, r.error)  # closed: the space is back


async def test_a_fallocate_burst_stops_at_the_limit(make_backend):
    """Issue 35: a ``fallocate`` burst left 1,860 MiB (58x the limit) in the layer."""
    backend, _ = await disk_backend(make_backend)
    slot = await backend.acquire("burst")
    r = await bash(backend, slot, "fallocate -l 16M /tmp/first && echo ok")
    assert r.output == "ok\n", (r.output, r.error)  # positive control
    r = await bash(backend, slot, "for i in $(seq 40); do fallocate -l 48M /tmp/fa$i || break; done 2>&1; "
                                  "ls /tmp/fa* 2>/dev/null | wc -l", timeout=30)
    assert "No space left on device" in r.output, (r.output, r.error)
    assert int(r.output.split()[-1]) <= 1, r.output
    assert used(await layer_path(backend, slot))[0] <= LIMIT_MIB * MIB


async def test_many_small_files_run_out_of_inodes_not_the_hosts(make_backend):
    """Issue 35: inodes were not counted at all (20,000-60,000 per counted MiB)."""
    backend, disk = await disk_backend(make_backend)
    slot = await backend.acquire("inodes")
    r = await bash(backend, slot, "mkdir /tmp/m && cd /tmp/m && for i in $(seq 500); do : > f$i; done; "
                                  "ls | wc -l")
    assert r.output.split()[-1] == "500", (r.output, r.error)  # positive control
    r = await bash(backend, slot, "cd /tmp/m && for i in $(seq 501 20000); do : > f$i || break; done 2>&1; "
                                  "ls | wc -l", timeout=60)
    assert "No space left on device" in r.output, (r.output[-300:], r.error)
    count = int(r.output.split()[-1])
    assert disk["inodes"] - 100 <= count <= disk["inodes"], (count, disk)
    assert used(await layer_path(backend, slot))[1] <= disk["inodes"]


async def test_a_full_slot_leaves_its_neighbour_and_its_next_tenant_their_space(make_backend):
    backend, _ = await disk_backend(make_backend)
    hog = await backend.acquire("hog")
    other = await backend.acquire("other")
    r = await bash(backend, hog, "head -c 200M /dev/zero > /var/tmp/fill; echo rc=$?", timeout=30)
    assert "No space left on device" in r.output and "rc=1" in r.output, (r.output, r.error)
    assert used(await layer_path(backend, hog))[0] >= (LIMIT_MIB - 8) * MIB  # it is full
    r = await bash(backend, other, "head -c 32M /dev/zero > /var/tmp/mine && echo ok")
    assert r.output == "ok\n", (r.output, r.error)  # the neighbour writes as before
    await backend.release(hog, reset_workspace=True)
    nxt = await backend.acquire("next")
    assert nxt.index == hog.index
    assert (await bash(backend, nxt, "ls /var/tmp/fill 2>&1")).success is False
    assert used(await layer_path(backend, nxt))[0] <= MIB  # the next tenant starts empty
    r = await bash(backend, nxt, "head -c 32M /dev/zero > /var/tmp/mine && echo ok")
    assert r.output == "ok\n", (r.output, r.error)


async def test_without_slot_disk_a_slot_gets_a_fair_share_of_the_free_disk(make_backend):
    backend = await make_backend(**SMALL)
    disk = backend.get_status()["pools"][backend.default_profile]["caps"]["disk"]
    assert disk["enforced"].startswith("kernel") and disk["default"] is True, disk
    state = Path(backend.get_status()["drivers"]["local"]["state_root"])
    share = os.statvfs(state).f_bavail * os.statvfs(state).f_frsize // MIB // SMALL["slots_per_sandbox"]
    assert abs(disk["mib"] - share) <= max(256, share // 20), (disk, share)
    assert "fair share" in disk["note"], disk
    slot = await backend.acquire("t")
    assert (await bash(backend, slot, "echo hi > /tmp/x")).success
    st = os.statvfs(await layer_path(backend, slot))
    assert abs(st.f_blocks * st.f_frsize // MIB - disk["mib"]) <= disk["mib"] // 10 + 8, (st, disk)


async def test_status_says_which_holds_in_every_mode(mode_backend):
    """Locally the kernel enforces ``slot_disk``; in the local Modal control plane's
    containers (no loop devices) and without bwrap the watch remains, and the status
    says so, with the reason."""
    backend = await mode_backend(**SMALL, slot_disk=LIMIT_MIB)
    disk = backend.get_status()["pools"][backend.default_profile]["caps"]["disk"]
    assert disk["mib"] == LIMIT_MIB, disk
    if mode_backend.mode == "local":
        assert disk["enforced"].startswith("kernel"), disk
    else:
        assert disk["enforced"] == "watched" and "no kernel limit here" in disk["note"], disk
    slot = await backend.acquire("t")
    r = await bash(backend, slot, "head -c 16M /dev/zero > /tmp/below && echo ok")
    assert r.output == "ok\n", (r.output, r.error)  # below the limit: fine in every mode
