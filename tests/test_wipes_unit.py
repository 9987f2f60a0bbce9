"""The agent's side of a workspace-only slot's reset (agent/fs/wipes.py), in process on a
real temporary workspace (milliseconds a test: the mutation script runs these against
every mutant, confined to a private /tmp).

With nothing of the slot running, the workspace is renamed to a root-only trash
directory beside it and a fresh, empty one made (a new directory: another inode), and the
trash is deleted on the "trash" worker; with a fresh shell holding the directory, or when
the rename fails, it is emptied in place (the same directory). Each verdict is taken on
the files, beside a positive control (what the last tenant wrote was there, and is in
the trash before it goes). A link the tenant left pointing at a canary outside must
never be followed: the canary is checked after every removal.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import stat
from pathlib import Path

import pytest

from hermes_modal_tool.agent.files.files import Workspace
from hermes_modal_tool.agent.fs import wipes

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the trash is chowned to root (as root)")

UID = GID = 4321  # the slot's uid (not this process's)
CANARY = b"host canary\n"


class AgentThreads:
    """The two members of the agent (agent/main.py) a reset uses: its event loop and its
    named worker threads (real thread pools), recording which names were asked for."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self.asked: list[str] = []

    def executor(self, name: str) -> concurrent.futures.ThreadPoolExecutor:
        self.asked.append(name)
        return self.pools.setdefault(name, concurrent.futures.ThreadPoolExecutor(1))

    def drain(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=True)


def tenant_files(ws: Path, outside: Path) -> None:
    """What a tenant leaves: files, a deep tree, a read-only directory, links out."""
    (ws / "notes.txt").write_text("secret")
    deep = ws / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "f").write_text("deep")
    ro = ws / "ro"
    ro.mkdir()
    (ro / "kept").write_text("x")
    ro.chmod(0o500)
    os.symlink(str(outside), ws / "out_dir")
    os.symlink(str(outside / "canary"), ws / "out_file")


@pytest.fixture
def slot(tmp_path: Path) -> tuple[Workspace, Path, Path]:
    """``(workspace, its directory, the outside directory with the canary)``: a slot's
    workspace owned by the slot's uid, mode 0700, with what a tenant left in it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary").write_bytes(CANARY)
    slots = tmp_path / "slots"
    slots.mkdir()
    ws = slots / "slot_1"
    ws.mkdir(mode=0o700)
    os.chown(ws, UID, GID)
    tenant_files(ws, outside)
    return Workspace(str(ws), "/workspace/slot_1", uid=UID, gid=GID), ws, outside


def fresh(ws: Path) -> None:
    st = os.lstat(ws)
    assert stat.S_ISDIR(st.st_mode) and os.listdir(ws) == []
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o700, UID, GID)


def canary_intact(outside: Path) -> None:
    assert (outside / "canary").read_bytes() == CANARY and os.listdir(outside) == ["canary"]


def test_swap_out_moves_the_tree_to_a_root_only_trash_and_makes_a_fresh_workspace(slot) -> None:
    workspace, ws, outside = slot
    old = os.stat(ws).st_ino
    trash = wipes.swap_out(workspace)
    assert trash is not None
    trash = Path(trash)
    assert trash.parent == ws.parent
    assert trash.name.startswith(f".hmt-trash-slot_1-{os.getpid()}-"), trash.name
    # Positive control: the old tree, as it was, is the trash (not copied: the same inode).
    st = os.lstat(trash)
    assert st.st_ino == old and (trash / "notes.txt").read_text() == "secret"
    assert (trash / "a" / "b" / "c" / "f").read_text() == "deep"
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o700, 0, 0)
    fresh(ws)
    assert os.stat(ws).st_ino != old
    wipes.remove(str(trash))
    assert sorted(os.listdir(ws.parent)) == ["slot_1"]
    canary_intact(outside)


def test_each_swap_has_its_own_trash(slot) -> None:
    workspace, ws, outside = slot
    first = wipes.swap_out(workspace)
    (ws / "second.txt").write_text("2")
    second = wipes.swap_out(workspace)
    assert first != second and os.path.isfile(os.path.join(second, "second.txt"))
    assert os.path.isfile(os.path.join(first, "notes.txt"))
    for trash in (first, second):
        wipes.remove(trash)
        assert not os.path.lexists(trash)
    fresh(ws)
    canary_intact(outside)


def test_swap_out_of_a_missing_workspace_makes_nothing(tmp_path: Path) -> None:
    ws = tmp_path / "slot_9"
    assert wipes.swap_out(Workspace(str(ws), "/workspace/slot_9", uid=UID, gid=GID)) is None
    assert os.listdir(tmp_path) == []


def test_remove_deletes_a_trash_file_too_and_a_missing_one_quietly(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    wipes.remove(str(f))
    wipes.remove(str(tmp_path / "missing"))
    assert os.listdir(tmp_path) == []


def reset(workspace: Workspace, stopped: bool) -> AgentThreads:
    async def go() -> AgentThreads:
        agent = AgentThreads(asyncio.get_running_loop())
        await wipes.reset_workspace(agent, workspace, stopped)
        return agent

    agent = asyncio.run(go())
    agent.drain()
    return agent


def test_a_stopped_slot_is_swapped_out_and_its_trash_deleted_in_the_background(slot) -> None:
    workspace, ws, outside = slot
    old = os.stat(ws).st_ino
    agent = reset(workspace, stopped=True)
    assert agent.asked == ["files", "trash"]
    fresh(ws)
    assert os.stat(ws).st_ino != old  # swapped (a new directory), not emptied in place
    assert sorted(os.listdir(ws.parent)) == ["slot_1"]  # the trash is gone
    canary_intact(outside)


def test_a_running_shell_keeps_its_directory_emptied_in_place(slot) -> None:
    workspace, ws, outside = slot
    old = os.stat(ws).st_ino
    agent = reset(workspace, stopped=False)
    assert agent.asked == ["files"]
    fresh(ws)
    assert os.stat(ws).st_ino == old
    assert sorted(os.listdir(ws.parent)) == ["slot_1"]
    canary_intact(outside)


def test_a_failed_rename_falls_back_to_emptying_in_place(tmp_path: Path) -> None:
    """A workspace name so long that its trash name is over NAME_MAX: the rename fails
    (ENAMETOOLONG) and the workspace is emptied in place instead."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary").write_bytes(CANARY)
    ws = tmp_path / ("w" * 250)  # 250 + len(".hmt-trash-" "-1-0") > NAME_MAX, whatever the pid
    ws.mkdir(mode=0o700)
    os.chown(ws, UID, GID)
    tenant_files(ws, outside)
    workspace = Workspace(str(ws), "/workspace/x", uid=UID, gid=GID)
    with pytest.raises(OSError):  # positive control: the swap itself fails here
        wipes.swap_out(workspace)
    assert (ws / "notes.txt").read_text() == "secret"
    old = os.stat(ws).st_ino
    agent = reset(workspace, stopped=True)
    assert agent.asked == ["files", "files"]
    fresh(ws)
    assert os.stat(ws).st_ino == old
    assert sorted(os.listdir(tmp_path)) == sorted(["outside", ws.name])
    canary_intact(outside)


def test_an_agent_not_running_as_root_swaps_without_chown(tmp_path: Path) -> None:
    """An agent without root (slots run as its own uid): the trash keeps the agent's
    owner (only root may give a file to root), mode 0700; run in a forked child whose
    only uid is the slot's, in the slots' directory (it cannot pass pytest's 0700
    directories above it: paths relative to it)."""
    slots = tmp_path / "slots"
    slots.mkdir()
    os.chown(slots, UID, GID)
    ws = slots / "slot_1"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(r)
            os.chdir(slots)
            os.setgroups([])
            os.setresgid(GID, GID, GID)
            os.setresuid(UID, UID, UID)
            os.mkdir("slot_1")
            with open("slot_1/f", "w") as f:
                f.write("x")
            os.write(w, str(wipes.swap_out(Workspace("slot_1", "/workspace/slot_1"))).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        name = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    trash = slots / name
    st = os.lstat(trash)
    assert name.startswith(".hmt-trash-slot_1-") and (trash / "f").is_file()  # positive control
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o700, UID, GID)
    assert os.listdir(ws) == [] and os.lstat(ws).st_uid == UID
