"""Class 4 of round two: a slot whose reset fails is quarantined (taken out of service,
retried, reported) while its neighbours keep running, in every mode."""

from __future__ import annotations

import asyncio
import io
import subprocess

import pytest
from support import SMALL, bash, settle

from hermes_modal_tool import PoolTimeoutError, TransferError


def chattr(flag: str, path) -> None:
    subprocess.run(["chattr", flag, str(path)], check=True, capture_output=True)


async def test_failed_reset_quarantines_the_slot_not_its_sandbox(mode_backend):
    """A reset that cannot empty a slot (its workspace directory made immutable from the
    host, where the sandbox's files are: no slot can do that; it can be neither moved
    away nor emptied) takes that slot out of service and retries it; its neighbour keeps
    running, nobody is handed the unwiped workspace, and the slot comes back once a
    retry succeeds."""
    backend = await mode_backend(**{**SMALL, "max_sandboxes": 1, "acquire_timeout_s": 1.0},
                                 filesystem="workspace-only")
    victim, neighbour = await backend.acquire("victim"), await backend.acquire("neighbour")
    assert (await bash(backend, victim, "echo secret > stuck.txt")).success
    workspace = mode_backend.view.workspace(backend, victim)
    stuck = workspace / "stuck.txt"
    assert (await asyncio.to_thread(stuck.read_text)) == "secret\n"
    await asyncio.to_thread(chattr, "+i", workspace)
    try:
        long = asyncio.ensure_future(bash(backend, neighbour, "sleep 1; echo still-here"))
        await backend.release(victim, reset_workspace=True)
        assert (await long).output == "still-here\n"
        status = backend.get_status()
        [q] = status["quarantined_slots"]
        assert q["slot_id"] == victim.slot_id and "could not empty the workspace" in q["error"], q
        assert status["sandboxes"] == 1 and status["quarantined"] == 1
        with pytest.raises(PoolTimeoutError):  # the quarantined slot is not handed out
            await backend.acquire("next")
        assert (await bash(backend, neighbour, "echo fine")).output == "fine\n"
    finally:
        await asyncio.to_thread(chattr, "-i", workspace)
    assert await settle(lambda: not backend.get_status()["quarantined_slots"], timeout=20)
    fresh = await backend.acquire("after")
    assert fresh.slot_id == victim.slot_id
    assert (await bash(backend, fresh, "ls -A; echo end")).output == "end\n"
    assert not await asyncio.to_thread(stuck.exists)


@pytest.mark.parametrize("filesystem", [None, "workspace-only"])
@pytest.mark.parametrize("reset_workspace", [False, True])
async def test_the_next_tenant_cannot_read_the_last_ones_files_before_its_first_call(
        mode_backend, filesystem, reset_workspace):
    """A reset answers the host once the old tenant's processes are killed, before its
    files are gone; the next tenant of the same slot transfers at once, before any call.
    Its download must not read the old tenant's file, and its upload must land in its own
    workspace (it went into the old layer and was lost). Red before the agent held
    transfers, tunnels and process/usage asks until the reset was over."""
    fields = {**SMALL, "slots_per_sandbox": 1, "max_sandboxes": 1, "min_sandboxes": 1}
    if filesystem:
        fields["filesystem"] = filesystem
    backend = await mode_backend(**fields)
    old = await backend.acquire("old-tenant")
    assert (await bash(backend, old, "echo secret-of-the-old-tenant > mine.txt")).success
    await backend.release(old, reset_workspace=reset_workspace)
    new = await backend.acquire("new-tenant")
    assert new.slot_id == old.slot_id  # the same slot, reused
    got = io.BytesIO()
    with pytest.raises(TransferError, match="no such file"):
        await backend.download(new, "mine.txt", got)
    assert b"secret" not in got.getvalue()
    await backend.upload(new, b"mine now\n", "up.txt")
    r = await bash(backend, new, "cat up.txt; ls -A")
    assert r.output == "mine now\nup.txt\n", r
