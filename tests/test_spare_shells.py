"""Shells started before their slot is acquired (spares of a new sandbox, and the next
shell of a slot just reset) are as fresh as shells started by the first command.

A sandbox starts shells ahead of use for the slots the host hands out next. These tests
wait until such a shell runs (seen from the host, as the slot's uid), then acquire the
slot and check what its first command sees: its own fresh root, the slot's clean
environment, nothing of a previous tenant, and file tools working on the same root.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from support import bash, layered, slot_host_uid

pytestmark = pytest.mark.usefixtures("needs_root")


@pytest.fixture
def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("slots of their own uid and root need the backend to run as root")


def slot_shells(uid: int) -> set[int]:
    """Host pids of the slot shells (``bash --noprofile --norc``) running as host ``uid``."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if not fh.read().startswith(b"bash\0--noprofile\0--norc"):
                    continue
            with open(f"/proc/{entry}/status") as fh:
                uids = next(line for line in fh if line.startswith("Uid:")).split()
        except (OSError, StopIteration):
            continue
        if int(uids[1]) == uid:
            pids.add(int(entry))
    return pids


async def wait_for_shell(uid: int, not_in: set[int] = frozenset(), limit_s: float = 60.0) -> int:
    """Wait until a shell of host ``uid`` (other than ``not_in``) runs; return its pid."""
    for _ in range(int(limit_s / 0.05)):
        new = slot_shells(uid) - set(not_in)
        if new:
            return min(new)
        await asyncio.sleep(0.05)
    raise AssertionError(f"no shell of uid {uid} was started ahead of use within {limit_s:g}s")


async def host_uid(backend, slot) -> int:
    """The host uid a slot runs as (its uid 0 inside maps to it), read on the host."""
    return await slot_host_uid(backend, slot)


FIRST_LOOK = ('echo "home=$HOME pwd=$PWD uid=$(id -u) x=${SPARE_X-unset}"; '
              'ls -A /root /tmp; test -e /etc/tenant && echo dirty || echo clean')


async def test_a_spare_shell_of_a_new_sandbox_runs_in_the_slots_own_fresh_root(make_backend):
    backend = await make_backend(slots_per_sandbox=3, min_sandboxes=1, max_sandboxes=1)
    if not layered(backend):
        pytest.skip("no layered root here")
    # Slot 0 tells the slots' uids; slots 1 and 2 have run nothing yet.
    slots = [await backend.acquire(f"s{i}") for i in range(3)]
    first_uid = await host_uid(backend, slots[0])
    spares = [first_uid + 1, first_uid + 2]  # slot uids are consecutive (uid_base + index)
    for uid in spares:
        await wait_for_shell(uid)  # started ahead of the slot's first command
    for slot in slots[1:]:
        result = await bash(backend, slot, FIRST_LOOK)
        assert result.success, result
        lines = result.output.splitlines()
        assert lines[0] == f"home=/root pwd={slot.workspace_dir} uid=0 x=unset", result.output
        assert lines[-1] == "clean", result.output
    # The spare shell and the file tools share the slot's one root.
    [wrote] = await backend.execute_batch([(slots[1], "write_file",
                                           {"path": "/etc/tenant", "content": "one\n"})])
    assert wrote.success, wrote
    assert (await bash(backend, slots[1], "cat /etc/tenant")).output == "one\n"
    assert (await bash(backend, slots[2], FIRST_LOOK)).output.splitlines()[-1] == "clean"


async def test_the_shell_started_after_a_reset_sees_nothing_of_the_last_tenant(make_backend):
    backend = await make_backend(slots_per_sandbox=2, min_sandboxes=1, max_sandboxes=1)
    if not layered(backend):
        pytest.skip("no layered root here")
    slot = await backend.acquire("tenant-1")
    uid = await host_uid(backend, slot)
    setup = await bash(backend, slot, (
        "echo secret >/root/secret; echo secret >/tmp/secret; echo x >/etc/tenant; "
        "export SPARE_X=1; cd /tmp; (sleep 300 &) ; echo ok"))
    assert setup.output == "ok\n", setup
    before = slot_shells(uid)
    assert before, "the tenant's shell runs as its slot's uid"
    await backend.release(slot, reset_workspace=True)
    # The slot's next shell starts in the background after the reset, before any acquire.
    fresh = await wait_for_shell(uid, not_in=before)
    assert not (before & slot_shells(uid)), "the last tenant's shell is gone"
    held = [await backend.acquire(f"tenant-2-{i}") for i in range(2)]
    again = [s for s in held if s.index == slot.index]
    assert again, held
    result = await bash(backend, again[0], FIRST_LOOK + "; pgrep -x sleep || echo no-sleep")
    assert result.success, result
    lines = result.output.splitlines()
    assert lines[0] == f"home=/root pwd={again[0].workspace_dir} uid=0 x=unset", result.output
    assert "secret" not in result.output, result.output
    assert lines[-2:] == ["clean", "no-sleep"], result.output
    assert fresh in slot_shells(uid), "the first command ran in the shell started ahead"
