"""Class 4 of round two: a slot whose reset fails is quarantined (taken out of service,
retried, reported) while its neighbours keep running, in every mode."""

from __future__ import annotations

import asyncio
import subprocess

import pytest
from support import SMALL, bash, settle

from hermes_modal_tool import PoolTimeoutError


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
