"""Slot shells with a layered root start through the agent's spawner (``agent/shells/spawner.py``):
a small process forked from the agent at its start, in a mount namespace of its own, that
clones each shell's bwrap as a child of the agent. These tests check what that must keep:
the shells are the agent's children (it waits for them), bwrap starts in a namespace that
holds none of the other slots' roots, and when the spawner is gone shells still start (the
agent falls back to ``Popen``), for used and fresh slots alike.
"""

from __future__ import annotations

import os
import signal

import pytest
from support import agent_processes, bash, layered, processes
from test_spare_shells import host_uid, slot_shells

pytestmark = pytest.mark.usefixtures("needs_root")


@pytest.fixture
def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the spawner needs the backend to run as root")


def children(pid: int) -> dict[int, str]:
    """Children of ``pid``: pid -> command line."""
    return {p: proc.cmdline for p, proc in processes().items() if proc.ppid == pid}


def spawner_of(agent: int) -> int:
    """The agent's spawner: its child running the agent's own executable and command line."""
    exe = os.readlink(f"/proc/{agent}/exe")
    with open(f"/proc/{agent}/cmdline", "rb") as fh:
        cmdline = fh.read()
    found = []
    for pid in children(agent):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                same = fh.read() == cmdline
            if same and os.readlink(f"/proc/{pid}/exe") == exe:
                found.append(pid)
        except OSError:
            continue
    assert len(found) == 1, (found, children(agent))
    return found[0]


def read_text(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def outer_bwrap(shell: int) -> int:
    """The outer bwrap of a slot shell (its parent's parent: bash <- bwrap init <- bwrap)."""
    init = processes()[shell].ppid
    return processes()[init].ppid


async def test_shells_are_children_of_the_agent_and_bwrap_sees_no_other_slots_root(make_backend):
    backend = await make_backend(slots_per_sandbox=6, min_sandboxes=1, max_sandboxes=1)
    if not layered(backend):
        pytest.skip("no layered root here")
    [agent] = agent_processes()
    slots = [await backend.acquire(f"s{i}") for i in range(6)]
    results = await backend.execute_batch([(s, "bash", {"command": "true"}) for s in slots])
    assert all(r.success for r in results), results
    spawner = spawner_of(agent)
    uid = await host_uid(backend, slots[-1])
    [shell] = slot_shells(uid)
    bwrap = outer_bwrap(shell)
    assert processes()[bwrap].ppid == agent, "the agent reaps its shells itself"
    # bwrap's own mount namespace (it copied its parent's): the other slots' roots are not
    # in it, nor the agent's state mounts, only the sandbox's own mounts and this root.
    seen = read_text(f"/proc/{bwrap}/mountinfo")
    for other in slots[:-1]:
        assert f"/slot_{other.index}/" not in seen, (other.index, seen)
    assert f"/slot_{slots[-1].index}/" in seen
    assert processes()[spawner].ppid == agent


async def test_shells_start_without_the_spawner(make_backend):
    """Kill the spawner: fresh slots' first shells (whose roots also need a user namespace,
    made by the spawner before) and a used slot's next shell still start."""
    backend = await make_backend(slots_per_sandbox=10, min_sandboxes=1, max_sandboxes=1)
    if not layered(backend):
        pytest.skip("no layered root here")
    [agent] = agent_processes()
    os.kill(spawner_of(agent), signal.SIGKILL)
    slots = [await backend.acquire(f"s{i}") for i in range(10)]
    results = await backend.execute_batch([(s, "bash", {"command": "echo one >/etc/mark; id -u"})
                                           for s in slots])
    assert all(r.success and r.output == "0\n" for r in results), results
    await backend.release(slots[0], reset_workspace=True)
    again = await backend.acquire("again")
    result = await bash(backend, again, "test -e /etc/mark && echo dirty || echo clean")
    assert result.success and result.output == "clean\n", result
    uid = await host_uid(backend, slots[-1])
    [shell] = slot_shells(uid)
    assert processes()[outer_bwrap(shell)].ppid == agent
