"""Snapshots and forks of slots: a fork starts from the parent's files and shell state,
writes privately, and a snapshot lives as long as someone holds it.

Everything through the public API on the local driver (real bubblewrap sandboxes).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from support import bash

from hermes_modal_tool import SlotSnapshot, SnapshotError, UsageError

pytestmark = pytest.mark.usefixtures("needs_root")


@pytest.fixture
def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("snapshots need a layered root (the backend must run as root)")


async def out(backend, slot, command: str) -> str:
    r = await bash(backend, slot, command)
    assert r.success, (command, r.error, r.output)
    return r.output


SETUP = """mkdir -p /workspace/proj && cd /workspace/proj
echo base > data.txt; echo 'print(41 + 1)' > /usr/local/bin/answer.py
export TASK_ID=task-7 GREETING='hello world'
greet() { echo "greet:$GREETING"; }
alias ll='echo listed'
"""


async def test_fork_sees_files_cwd_exports_functions_and_aliases(make_backend):
    backend = await make_backend(slots_per_sandbox=4, max_sandboxes=1)
    parent = await backend.acquire("parent")
    await out(backend, parent, SETUP)
    forks = await backend.fork(parent, 2, trajectory_ids=["f1", "f2"])
    assert [f.trajectory_id for f in forks] == ["f1", "f2"]
    assert {f.sandbox_id for f in forks} == {parent.sandbox_id}
    for f in forks:
        got = await out(backend, f, "pwd; cat data.txt; echo $TASK_ID; greet; ll; python3 /usr/local/bin/answer.py")
        assert got.split("\n")[:6] == ["/workspace/proj", "base", "task-7", "greet:hello world",
                                       "listed", "42"]
        # file tools see the same state
        r = await backend.read_artifact(f, "/workspace/proj/data.txt")
        assert r["content"] == "base\n"
    # the parent goes on from the same state
    assert (await out(backend, parent, "pwd; echo $TASK_ID")).split() == ["/workspace/proj", "task-7"]


async def test_writes_in_a_fork_are_private(make_backend):
    backend = await make_backend(slots_per_sandbox=4, max_sandboxes=1)
    parent = await backend.acquire("parent")
    await out(backend, parent, SETUP)
    snap = await backend.snapshot(parent)
    a, b = await backend.fork(snap, 2)
    await out(backend, a, "echo from-a > data.txt; echo new > a-only.txt; rm /usr/local/bin/answer.py")
    await out(backend, parent, "echo from-parent >> data.txt")
    assert (await out(backend, b, "cat data.txt; ls; test -e /usr/local/bin/answer.py && echo kept")
            ).split() == ["base", "data.txt", "kept"]
    assert (await out(backend, parent, "cat data.txt; ls")).split() == ["base", "from-parent", "data.txt"]
    assert (await out(backend, a, "cat data.txt; ls")).split() == ["from-a", "a-only.txt", "data.txt"]
    # a new fork of the snapshot sees neither write
    [c] = await backend.fork(snap, 1)
    assert (await out(backend, c, "cat data.txt; ls")).split() == ["base", "data.txt"]
    await backend.release_snapshot(snap)


async def test_snapshot_outlives_parent_reset_and_is_freed_by_last_holder(make_backend):
    backend = await make_backend(slots_per_sandbox=3, max_sandboxes=1)
    parent = await backend.acquire("parent")
    await out(backend, parent, "cd /srv && head -c 300000 /dev/urandom > blob && export K=v")
    snap = await backend.snapshot(parent)
    assert isinstance(snap, SlotSnapshot) and snap.size_bytes >= 300000
    await backend.release(parent, reset_workspace=True)
    fork = await backend.acquire("child", snapshot=snap)
    assert (await out(backend, fork, "pwd; echo $K; wc -c < blob")).split() == ["/srv", "v", "300000"]
    [listed] = backend.get_status()["snapshots"]
    assert listed["snapshot_id"] == snap.snapshot_id and listed["size_bytes"] == snap.size_bytes
    assert listed["holders"] == ["caller", "child"]
    await backend.release_snapshot(snap)
    assert backend.get_status()["snapshots"][0]["holders"] == ["child"]
    with pytest.raises(UsageError, match="released"):
        await backend.fork(snap, 1)
    sb = backend._pools[parent.profile]._sandboxes[parent.sandbox_id]
    agent_view = await sb.request({"op": "snapshots"}, 10)
    assert len(agent_view["result"]["snapshots"]) == 1
    await backend.release(fork, reset_workspace=True)
    assert backend.get_status()["snapshots"] == []
    agent_view = await sb.request({"op": "snapshots"}, 10)
    assert agent_view["result"] == {"snapshots": [], "total_bytes": 0}


async def test_fork_cannot_see_other_slots(make_backend):
    backend = await make_backend(slots_per_sandbox=4, max_sandboxes=1)
    parent, other = await backend.acquire("parent"), await backend.acquire("other")
    await out(backend, other, "echo secret > /root/other.txt; echo $$ > /tmp/pid")
    await out(backend, parent, "echo mine > /root/mine.txt")
    [fork] = await backend.fork(parent, 1)
    got = await out(backend, fork, "ls /root; id -u; cat /proc/1/cmdline | tr '\\0' ' '; "
                                   "ls /data 2>/dev/null | wc -l; touch /etc/x && echo wrote")
    lines = got.split("\n")
    assert lines[0] == "mine.txt" and lines[1] == "0" and "wrote" in got
    assert "other.txt" not in got
    r = await backend.read_artifact(fork, "/root/other.txt")
    assert not r["success"]
    # the host's /etc is untouched
    assert not Path("/etc/x").exists()  # noqa: ASYNC240 - one stat


async def test_snapshot_disk_cap_refuses_and_names_it(make_backend):
    backend = await make_backend(slots_per_sandbox=2, max_sandboxes=1, snapshot_disk=1)
    slot = await backend.acquire()
    await out(backend, slot, "head -c 2000000 /dev/zero > /root/big")
    with pytest.raises(SnapshotError, match="snapshot_disk"):
        await backend.snapshot(slot)
    assert (await out(backend, slot, "wc -c < /root/big")).strip() == "2000000"


async def test_sixteen_forks_at_once(make_backend):
    backend = await make_backend(slots_per_sandbox=17, max_sandboxes=1, acquire_timeout_s=30)
    parent = await backend.acquire("p")
    await out(backend, parent, "mkdir -p /w && cd /w && seq 1 1000 > n.txt")
    snap = await backend.snapshot(parent)
    forks = await backend.fork(snap, 16)
    results = await backend.execute_batch(
        [(f, "bash", {"command": f"echo {i} >> n.txt; tail -n1 n.txt; wc -l < n.txt"})
         for i, f in enumerate(forks)])
    assert [r.output.split() for r in results] == [[str(i), "1001"] for i in range(16)]
    await asyncio.gather(*(backend.release(f) for f in forks))
    await backend.release_snapshot(snap)


async def test_a_fork_finds_the_parents_workspace_at_its_own(make_backend):
    backend = await make_backend(slots_per_sandbox=3, max_sandboxes=1)
    parent = await backend.acquire("parent")
    await out(backend, parent, "echo notes > notes.txt; mkdir sub && cd sub && echo deep > d.txt")
    [fork] = await backend.fork(parent, 1)
    assert fork.workspace_dir != parent.workspace_dir
    assert (await out(backend, fork, "pwd; cat d.txt ../notes.txt")).split() == [
        f"{fork.workspace_dir}/sub", "deep", "notes"]
    r = await backend.read_artifact(fork, "notes.txt")  # relative: the fork's own workspace
    assert r["content"] == "notes\n"
    await out(backend, fork, "echo mine >> ../notes.txt")
    assert (await out(backend, parent, "cat ../notes.txt")) == "notes\n"
    # a fork of the fork (another slot again) follows both
    [grandchild] = await backend.fork(fork, 1)
    assert (await out(backend, grandchild, "pwd; cat ../notes.txt")).split() == [
        f"{grandchild.workspace_dir}/sub", "notes", "mine"]
