"""The host matrix as tests: this host's limits, always (:mod:`tests.hosts.probe`, about
20 s), and each VM cell where ``HERMES_MODAL_TOOL_HOSTS=1`` asks for them (each boots a
VM and runs the main job and the isolation and limit tests there: minutes, far more
under TCG, so not in the default suite; see README "Host matrix")."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.hosts import probe, rootfs, run, vm

pytestmark = pytest.mark.hosts


async def test_this_hosts_limits_hold_as_its_mode_promises():
    """Whatever this host's mode: a slot past its slot_memory fails with the memory limit
    in its error while its neighbour's process keeps running, and the slot works again;
    with cgroups also three processes that each stay under slot_memory but together pass
    it are cut short (a slot total), the sandbox's CPU cap holds a busy loop to about
    cpu=0.5, and caps name a per-slot cgroup limit. Without cgroups the status says why."""
    result = await probe.main()
    row = {"cell": "host", "probe": result, "main": None, "tests": None}
    assert run.verdict(row), result


@pytest.mark.skipif(not os.environ.get("HERMES_MODAL_TOOL_HOSTS"),
                    reason="VM cells run with HERMES_MODAL_TOOL_HOSTS=1 (minutes each: "
                           "python -m tests.hosts.run prints the table)")
@pytest.mark.parametrize("cell", ["v2-root", "v2-user", "v2-user-nouserns", "v2-user-systemd",
                                  "d13-root"])
async def test_vm_cell(cell):
    why = vm.missing() or (rootfs.missing() if cell == "d13-root" else None)
    if why:
        pytest.skip(why)
    row = await asyncio.to_thread(run.run_cell, cell, os.environ.get("HERMES_MODAL_TOOL_HOSTS") == "quick",
                                  3600)
    assert row["ok"], run.table([row]) + "\n" + row["log"][-4000:]
