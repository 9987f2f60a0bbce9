"""Slot shells with a layered root start from a new thread of the agent
(``agent/shells/threadstart.py``): the thread takes on the slot's mount namespace, cgroups,
Landlock domain, uid and session keyring, then ``vfork``\\ s bwrap. These tests check what
that must keep: bwrap is the agent's child and runs as the slot's uid, the agent never
stays in a slot's cgroups (a ``kill_slot`` would find it there), the starting thread keeps
nothing of root, and it lives exactly as long as its shell (bwrap's ``--die-with-parent``
is tied to the thread that started it).
"""

from __future__ import annotations

import asyncio
import glob
import os
import signal

import pytest
from support import agent_processes, bash, layered, processes, settle
from test_spare_shells import host_uid, slot_shells
from test_spawner import outer_bwrap, read_text

pytestmark = pytest.mark.usefixtures("needs_root_and_v1")


@pytest.fixture
def needs_root_and_v1() -> None:
    if os.geteuid() != 0:
        pytest.skip("shells start from a thread only when the backend runs as root")
    if not os.path.isfile("/sys/fs/cgroup/memory/tasks"):
        pytest.skip("shells start from a thread only with cgroup v1")


def threads(pid: int) -> dict[int, str]:
    """The threads of ``pid``: tid -> name (``comm``)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = read_text(f"/proc/{pid}/task/{tid}/comm").strip()
        except OSError:
            continue
    return out


def status_field(path: str, name: str) -> list[str]:
    line = next(x for x in read_text(path).splitlines() if x.startswith(name + ":"))
    return line.split()[1:]


async def test_a_shell_starts_from_a_thread_that_leaves_the_slots_cgroups(make_backend):
    backend = await make_backend(slots_per_sandbox=3, min_sandboxes=1, max_sandboxes=1)
    if not layered(backend):
        pytest.skip("no layered root here")
    [agent] = agent_processes()
    slots = [await backend.acquire(f"s{i}") for i in range(3)]
    results = await backend.execute_batch([(s, "bash", {"command": "true"}) for s in slots])
    assert all(r.success for r in results), results
    names = threads(agent)
    for s in slots:
        starters = [tid for tid, name in names.items() if name == f"hmt-start-{s.index}"]
        assert len(starters) == 1, names
        uid = await host_uid(backend, s)
        [shell] = slot_shells(uid)
        bwrap = outer_bwrap(shell)
        assert processes()[bwrap].ppid == agent, "the agent reaps its shells itself"
        # bwrap starts in a copy of the spawner's namespace without /sys (its cgroup
        # hierarchies are a dozen mounts bwrap would read about nine times per start).
        seen = read_text(f"/proc/{bwrap}/mountinfo")
        assert " /sys" not in seen and f"/slot_{s.index}/" in seen, seen
        # The thread that started the shell keeps the slot's credentials, none of root.
        task = f"/proc/{agent}/task/{starters[0]}/status"
        assert status_field(task, "Uid") == [str(uid)] * 4
        assert int(status_field(task, "CapEff")[0], 16) == 0
        assert int(status_field(task, "CapPrm")[0], 16) == 0
    # No thread of the agent is in a slot's cgroup: it left them right after the start.
    for tid in threads(agent):
        cgroups = read_text(f"/proc/{agent}/task/{tid}/cgroup")
        assert "/slot_" not in cgroups, (tid, threads(agent), cgroups)


async def test_the_starting_thread_lives_as_long_as_its_shell(make_backend):
    """bwrap dies with the thread that started it: the shell must outlive the start (a
    second command runs in the same shell), and the thread must end with the shell."""
    backend = await make_backend(slots_per_sandbox=1, min_sandboxes=1, max_sandboxes=1)
    if not layered(backend):
        pytest.skip("no layered root here")
    [agent] = agent_processes()
    slot = await backend.acquire("a")
    first = await bash(backend, slot, "echo $$")
    await asyncio.sleep(0.5)
    second = await bash(backend, slot, "echo $$")
    assert first.success and second.success and first.output == second.output, (first, second)
    [old] = [tid for tid, name in threads(agent).items() if name == "hmt-start-0"]
    await backend.release(slot, reset_workspace=True)
    # The reset killed the shell: its thread ends; the slot's next shell (started ahead)
    # has a thread of its own.
    assert await settle(lambda: old not in threads(agent), timeout=5), threads(agent)
    slot = await backend.acquire("b")
    third = await bash(backend, slot, "echo $$")
    assert third.success, third
    assert [name for name in threads(agent).values()].count("hmt-start-0") == 1, threads(agent)


async def test_a_killed_agent_takes_its_shells_with_it(make_backend):
    """SIGKILL to the agent ends every thread, and so every bwrap started from one."""
    backend = await make_backend(slots_per_sandbox=2, min_sandboxes=1, max_sandboxes=1)
    if not layered(backend):
        pytest.skip("no layered root here")
    [agent] = agent_processes()
    slots = [await backend.acquire(f"s{i}") for i in range(2)]
    uids = [await host_uid(backend, s) for s in slots]
    shells = set().union(*(slot_shells(uid) for uid in uids))
    assert len(shells) == 2, shells
    os.kill(agent, signal.SIGKILL)
    assert await settle(lambda: not (shells & set(processes())), timeout=5), shells
    # stop() removes the dead sandbox's cgroups too (its driver retries while the
    # killed namespaces go: CI once left slot_0 and slot_1 of this test behind).
    name = make_backend.profile_name
    await backend.stop()
    left = [os.path.join(d, e) for d in glob.glob("/sys/fs/cgroup/*/hermes-modal-tool")
            for e in os.listdir(d) if f"-{name}-" in e]
    assert not left, left


CHECK_MOVES = """
import os, sys
from hermes_modal_tool.agent.shells import threadstart
dirs = sys.argv[1:]
own = threadstart._own_tasks_fds()
threadstart._check_thread_moves([os.path.join(d, "tasks") for d in dirs], own)
try:
    # cgroup.procs moves the whole process: the check must refuse (as on a kernel that
    # moved every thread).
    threadstart._check_thread_moves([os.path.join(d, "cgroup.procs") for d in dirs], own)
except OSError as exc:
    print("refused:", exc)
else:
    print("accepted")
"""


def test_the_check_refuses_a_cgroup_join_that_moves_the_whole_process(tmp_path):
    """Before any start from a thread, the agent checks that a thread joins a cgroup alone
    (here: a ``tasks`` file passes, and ``cgroup.procs``, which moves the whole process,
    is refused). Run in a child process, which ends in the scratch cgroups it made."""
    import subprocess
    import sys

    name = f"hmt-test-{os.getpid()}"
    dirs = [f"/sys/fs/cgroup/{ctrl}/{name}" for ctrl in ("memory", "pids", "cpu")]
    for d in dirs:
        os.makedirs(d, exist_ok=True)
    try:
        run = subprocess.run([sys.executable, "-c", CHECK_MOVES, *dirs], capture_output=True,
                             text=True, timeout=60)
    finally:
        for d in dirs:
            os.rmdir(d)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("refused:") and "does not join a cgroup v1 alone" in run.stdout, \
        run.stdout
