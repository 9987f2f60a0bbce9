"""Classes 2 and 4 of round two, in every mode: what one slot makes large (a wide or very
deep workspace, many files, a huge file, a flood of output) never stalls the agent for
its neighbours, and a reset wipes it without recursion and without quarantine.

Checked on the neighbour's side: its ``echo`` keeps answering while the heavy slot's
operation runs (``benchmarks/neighbours.py`` measures the p99 at full size; here the sizes
are smaller and the bound loose, for a shared 2-core machine, but far below the
multi-second stalls these caused)."""

from __future__ import annotations

import asyncio
import time

from support import SMALL, bash

from .helpers import call

#: Longest a neighbour's ``echo`` may take while another slot works (s).
STALL_S = 1.5
DIRS, FILES, DEPTH = 6_000, 20_000, 30_000


async def echoes_during(backend, neighbour, heavy) -> tuple[list[float], object]:
    """Run ``heavy()`` while ``neighbour`` echoes back to back; (latencies, heavy's result)."""
    stop, lat = asyncio.Event(), []

    async def loop() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = await bash(backend, neighbour, "echo hi")
            lat.append(time.perf_counter() - t0)
            assert r.output == "hi\n", (r.output, r.error)
            await asyncio.sleep(0.01)

    task = asyncio.ensure_future(loop())
    await asyncio.sleep(0.1)
    try:
        result = await heavy()
    finally:
        await asyncio.sleep(0.1)
        stop.set()
        await task
    return lat, result


async def test_heavy_work_of_one_slot_never_stalls_its_neighbour(mode_backend):
    backend = await mode_backend(**{**SMALL, "max_sandboxes": 1, "execution_timeout_s": 120})
    neighbour, heavy = await backend.acquire("neighbour"), await backend.acquire("heavy")
    r = await bash(backend, heavy, f"mkdir many && (cd many && seq {DIRS} | xargs mkdir) && mkdir files && "
                                   f"python3 -c 'import os\nfor i in range({FILES}): open(\"files/%d\" % i, \"w\")' && "
                                   "yes | head -c 64M > big.txt && echo ready", timeout=120)
    assert r.output == "ready\n", (r.output, r.error)
    seen = {}

    async def archive():
        return await call(backend, heavy, "archive_artifacts", path="files")

    async def read():
        return await call(backend, heavy, "read_file", path="big.txt", limit=1)

    async def flood():
        return await bash(backend, heavy, "timeout 2 yes; echo flooded", timeout=30)

    async def reset():
        await backend.release(heavy, reset_workspace=True)
        return await backend.acquire("heavy-again")

    for name, op in (("archive", archive), ("read_file", read), ("flood", flood), ("reset", reset)):
        lat, result = await echoes_during(backend, neighbour, op)
        seen[name] = (len(lat), max(lat))
        assert lat and max(lat) < STALL_S, (name, seen)
        if name == "archive":
            assert result.success and result.metadata["entries"] >= FILES, (result.error, result.metadata)
        elif name == "read_file":
            assert result.success and result.output == "y\n", result.error
        elif name == "flood":
            assert result.output.endswith("flooded\n") and result.metadata["truncated"]
        else:
            heavy = result
    assert not backend.get_status()["quarantined_slots"]
    assert (await bash(backend, heavy, "ls -A; echo end")).output == "end\n"


async def test_a_very_deep_tree_is_wiped_without_quarantine(mode_backend):
    """30,000 nested directories (past any recursion limit; tests/security/
    test_attack_round_two.py removes 100,000 under a limit of 64 open files): the reset
    wipes them (a workspace-only slot's in the background, after an O(1) swap), the slot is not quarantined, the next tenant finds an
    empty workspace and the neighbour answers throughout."""
    backend = await mode_backend(**{**SMALL, "max_sandboxes": 1, "execution_timeout_s": 120})
    neighbour, deep = await backend.acquire("neighbour"), await backend.acquire("deep")
    make = (f"python3 -c 'import os\nfor _ in range({DEPTH}):\n os.mkdir(\"d\"); os.chdir(\"d\")\n"
            "open(\"bottom\", \"w\").write(\"x\")' && echo made")
    r = await bash(backend, deep, make, timeout=120)
    assert r.output == "made\n", (r.output, r.error)

    async def reset():
        await backend.release(deep, reset_workspace=True)
        return await backend.acquire("next-tenant")

    lat, fresh = await echoes_during(backend, neighbour, reset)
    assert lat and max(lat) < STALL_S, max(lat)
    assert fresh.slot_id == deep.slot_id
    assert not backend.get_status()["quarantined_slots"]
    assert (await bash(backend, fresh, "ls -A; echo end")).output == "end\n"
