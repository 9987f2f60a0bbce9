"""The reset decision of a slot with a layered root (``SlotRuntime.reset`` in
agent/slot.py), in process: no sandbox starts.

Which slots get a new root (one that ran a call, or whose shell ran a command), which
keep theirs (nothing ran), and when a pre-started shell is kept (it never ran a command
and the slot did not run anything): taken on the slot's real root (overlay mounts in a
mount namespace of the child's own, as in tests/test_rootfs_unit.py), its real control
directory and its real, never started shell. Two members of the agent are stand-ins that
record what the reset asks of them: the slot's cgroups (``kill_slot``: no cgroup tree in
a confined run) and ``layer_work`` (the background retirement, tested in
test_rootfs_unit.py); the shell's ``stop`` is the real one, watched for the callback the
reset hands it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from pathlib import Path

from test_rootfs_unit import UID, in_private_ns, main, mount_points

if __name__ != "__main__":  # the child (main) needs no pytest
    import pytest

    pytestmark = pytest.mark.skipif(
        os.geteuid() != 0 or not __import__("shutil").which("unshare"),
        reason="a layered root needs root (mounts) and unshare(1) for a private mount namespace")


class Cgroups:
    """The slot cgroups' one member a reset uses (``kill_slot``), recorded."""

    def __init__(self) -> None:
        self.killed: list[int] = []

    def kill_slot(self, index: int, spare: int | None = None, one: bool = False) -> None:
        self.killed.append(index)


class AgentParts:
    """The members of the agent (agent/main.py) a slot with a layered root and its reset
    use, on the image ``top/img``; ``layer_work`` records what it is handed."""

    def __init__(self, top: str, loop: asyncio.AbstractEventLoop) -> None:
        from hermes_modal_tool.agent.fs import rootplan

        img = os.path.join(top, "img")
        for d in ("etc/apt/apt.conf.d", "workspace"):
            os.makedirs(os.path.join(img, d))
        with open(os.path.join(img, "etc", "image-file"), "w") as fh:
            fh.write("from the image\n")
        self.loop = loop
        self.workspace_base = "/workspace"
        self.host_root = os.path.join(top, "ws")
        self.ctl_root = os.path.join(top, "ctl")
        self.uid_base = UID - 1  # slot 1 runs as UID
        self.env: dict = {}
        self.isolation = "bwrap"
        self.filesystem = "overlay"
        self.state_dir = os.path.join(top, "state")
        self.upper_plan = rootplan.UpperPlan.for_image(img)
        self.trash_dir = os.path.join(top, "trash")
        os.makedirs(self.trash_dir)
        self.workdir = None
        self.volumes: list = []
        self.template_dir = os.path.join(top, "tpl")
        os.mkdir(self.template_dir)
        self.layer_spares = self.shared_template = self.layer_disks = None
        self.config: dict = {}
        self.slot_disk_mb = 0
        self.cgroups = Cgroups()
        self.net = None
        self.shm_watch = None
        self.handed: list = []
        self._pools: dict = {}

    def executor(self, name: str) -> concurrent.futures.ThreadPoolExecutor:
        return self._pools.setdefault(name, concurrent.futures.ThreadPoolExecutor(1))

    def layer_work(self, root, old) -> None:
        self.handed.append((root, old))


def leave_a_file(merged: str) -> None:
    """The last tenant's file in the root ``merged`` (in its layer)."""
    with open(merged + "/etc/tenant", "w") as fh:
        fh.write("the last tenant's\n")


def shows_tenant(merged: str) -> bool:
    """Whether the root ``merged`` shows the last tenant's file (one stat)."""
    return os.path.exists(merged + "/etc/tenant")


async def slot_of(top: str):
    """``(agent parts, slot 1)`` with its root mounted, a standby ready, a control file
    written and what its last tenant left (a file in its root, shell state), and its
    shell's ``stop`` watched (``slot.stops``: the ``on_kill`` each call got)."""
    from hermes_modal_tool.agent.slot import SlotRuntime

    agent = AgentParts(top, asyncio.get_running_loop())
    slot = SlotRuntime(agent, 1)
    slot.prepare_dirs()
    root = slot.root
    await agent.loop.run_in_executor(None, root.ensure)
    await agent.loop.run_in_executor(None, root.prepare_standby)
    leave_a_file(root.merged)
    slot.write_ctl("cmd", b"echo hi\n")
    assert os.listdir(slot.ctl_host) == ["cmd"]  # positive control
    slot.replay, slot.replay_text, slot.background_sids = {"cwd": "/x"}, "x", ["7"]
    slot.shell.resume_dir = "/srv"
    slot.stops = []
    stop = slot.shell.stop

    async def watched(on_kill=None):
        slot.stops.append(on_kill)
        await stop(on_kill=on_kill)

    slot.shell.stop = watched
    return agent, slot


def cleared(slot) -> None:
    """What every reset clears, whatever it stops."""
    assert slot.replay is None and slot.replay_text is None and slot.background_sids == []
    assert slot.shell.resume_dir is None and slot.dirty is False


async def a_slot_that_ran_a_call_gets_the_standby_root(top: str, used: bool) -> None:
    agent, slot = await slot_of(top)
    root = slot.root
    first, standby = root.active, root.standby
    slot.dirty, slot.shell.used = not used, used  # a file tool ran / the shell ran a command
    killed = []
    await slot.reset(on_killed=lambda: killed.append(1))
    assert root.active is standby and root.standby is None  # pointers only
    assert not shows_tenant(root.merged)
    assert agent.handed == [(root, first)]  # to be unmounted and deleted in the background
    assert first.merged in mount_points() and shows_tenant(first.merged)
    assert len(slot.stops) == 1 and slot.stops[0] is not None  # killed early: its own layer
    assert killed == []  # no shell ran: nothing was killed
    assert agent.cgroups.killed == [1]
    assert os.listdir(slot.ctl_host) == [] and slot.ctl_fds == {}
    cleared(slot)


def body_a_slot_that_ran_a_call_gets_the_standby_root(top: str) -> None:
    asyncio.run(a_slot_that_ran_a_call_gets_the_standby_root(top, used=False))


def body_a_slot_whose_shell_ran_a_command_gets_the_standby_root(top: str) -> None:
    asyncio.run(a_slot_that_ran_a_call_gets_the_standby_root(top, used=True))


def body_a_slot_that_ran_nothing_keeps_its_root(top: str) -> None:
    async def run() -> None:
        agent, slot = await slot_of(top)
        root = slot.root
        first, standby = root.active, root.standby
        stray = os.path.join(slot.ctl_host, "stray")
        os.mkdir(stray)  # a name unlink cannot remove: the reset goes on
        await slot.reset()
        assert root.active is first and root.standby is standby and agent.handed == []
        assert os.listdir(slot.ctl_host) == ["stray"]
        os.rmdir(stray)
        assert shows_tenant(root.merged)  # the same layer (the file stands for its state)
        # No shell runs: it is stopped all the same, and the control directory emptied.
        assert len(slot.stops) == 1 and agent.cgroups.killed == [1]
        assert os.listdir(slot.ctl_host) == []
        cleared(slot)

    asyncio.run(run())


def body_a_pre_started_shell_is_kept_until_the_slot_runs_something(top: str) -> None:
    async def run() -> None:
        agent, slot = await slot_of(top)
        root = slot.root
        first = root.active
        shell = slot.shell
        shell.starting = asyncio.ensure_future(asyncio.sleep(0.3))  # started after the last reset
        await slot.reset()
        assert slot.stops == [] and not shell.kill_on_start and not shell.starting.done()
        assert os.listdir(slot.ctl_host) == ["cmd"] and agent.cgroups.killed == []
        assert root.active is first and agent.handed == []
        cleared(slot)
        # The slot ran a call meanwhile: the shell goes (its start killed), and the root.
        slot.dirty = True
        await slot.reset()
        assert len(slot.stops) == 1 and shell.kill_on_start and shell.starting.done()
        assert root.active is not first and agent.handed == [(root, first)]
        assert os.listdir(slot.ctl_host) == [] and agent.cgroups.killed == [1]

    asyncio.run(run())


def body_a_forks_layer_is_let_go_and_not_killed_early(top: str) -> None:
    from hermes_modal_tool.agent.state import snapshots

    async def run() -> None:
        agent, slot = await slot_of(top)
        root = slot.root
        # A snapshot of the tenant's layer, held by a client, and the slot put on it (a
        # fork: the snapshots' own code).
        layer = await agent.loop.run_in_executor(None, root.freeze)
        frozen = snapshots.store(agent).add(layer.dir, UID, None, 0, "")
        frozen.holds = 1
        await snapshots._stack(agent, slot, frozen, "")
        fork = root.active
        assert fork.stack is frozen and frozen.users == 1 and shows_tenant(root.merged)
        agent.handed = []
        await slot.reset(on_killed=lambda: None)
        # The snapshots the fork holds are let go after the teardown (the answer says so).
        assert slot.stops == [None]
        assert agent.handed == [(root, fork)] and root.active is not fork
        assert not shows_tenant(root.merged)
        assert fork.stack is None and frozen.users == 0  # the fork no longer uses it
        assert snapshots.store(agent).get(frozen.id) is frozen  # still held: kept

    asyncio.run(run())


def body_a_slot_whose_root_was_never_built_is_reset_all_the_same(top: str) -> None:
    """A call ran but the slot's root could not be built (say, the disk was full): the
    reset has no layer to drop and goes on (the next start builds one)."""
    from hermes_modal_tool.agent.slot import SlotRuntime

    async def run() -> None:
        agent = AgentParts(top, asyncio.get_running_loop())
        slot = SlotRuntime(agent, 1)
        slot.prepare_dirs()
        slot.dirty = True
        await slot.reset()
        assert slot.root.active is None and agent.handed == [(slot.root, None)]
        assert agent.cgroups.killed == [1]
        await agent.loop.run_in_executor(None, slot.root.ensure)
        assert slot.root.active is not None and slot.dirty is False  # built on demand

    asyncio.run(run())


def body_a_slot_without_namespaces_has_its_uids_processes_and_tmp_files_purged(top: str) -> None:
    """A workspace-only slot without namespaces (``isolation: none``): a process of its
    uid may have left the shell's session and its files in /tmp outlive it, so a reset
    ends every process of the uid and removes its files there; a slot in bwrap has a /tmp
    and processes of its own, so nothing is purged. The child has a PID and an IPC
    namespace and tmpfs /tmp, /var/tmp and /dev/shm of its own: the purge reaches
    nothing of the host."""
    import subprocess
    import threading

    from hermes_modal_tool.agent.fs import mounts, trees  # noqa: F401 - see below
    from hermes_modal_tool.agent.limits import sysvipc  # noqa: F401
    from hermes_modal_tool.agent.slot import SHARED_TMP, SlotRuntime

    # The tmpfs hides the host's /tmp, where this tree may be (a mutation run's copy):
    # what the purge imports when it runs is imported above, before.
    for shared in SHARED_TMP:
        os.makedirs(shared, exist_ok=True)
        mounts.mount_tmpfs(shared, "size=1024k,mode=1777")

    def tenant_leaves(isolation: str) -> tuple[subprocess.Popen, str]:
        """A process of the slot's uid and its file in /tmp."""
        proc = subprocess.Popen(["sleep", "60"], user=UID, group=UID, extra_groups=[])
        threading.Thread(target=proc.wait, daemon=True).start()  # reaped when killed
        left = os.path.join("/tmp", "left-" + isolation)
        with open(left, "w"):
            pass
        os.chown(left, UID, UID)
        return proc, left

    def still_there(proc: subprocess.Popen, left: str) -> tuple[bool, bool]:
        return proc.poll() is None, os.path.exists(left)

    async def reset(isolation: str) -> tuple[bool, bool]:
        """``(its process ran on, its /tmp file is there)`` after a reset."""
        proc, left = tenant_leaves(isolation)
        agent = AgentParts(os.path.join(top, isolation), asyncio.get_running_loop())
        agent.filesystem, agent.cgroups = "workspace-only", None
        agent.isolation = "".join(isolation)  # a value read from the agent's config
        slot = SlotRuntime(agent, 1)
        slot.prepare_dirs()
        assert still_there(proc, left) == (True, True)  # positive control
        await slot.reset()
        await asyncio.sleep(0.05)
        seen = still_there(proc, left)
        proc.kill()
        return seen

    assert asyncio.run(reset("bwrap")) == (True, True)
    assert asyncio.run(reset("none")) == (False, False)


if __name__ == "__main__":
    main(globals())


# -- the tests ---------------------------------------------------------------------------

def test_a_slot_that_ran_a_call_gets_the_standby_root(tmp_path: Path) -> None:
    in_private_ns("a_slot_that_ran_a_call_gets_the_standby_root", tmp_path, __file__)


def test_a_slot_whose_shell_ran_a_command_gets_the_standby_root(tmp_path: Path) -> None:
    in_private_ns("a_slot_whose_shell_ran_a_command_gets_the_standby_root", tmp_path, __file__)


def test_a_slot_that_ran_nothing_keeps_its_root(tmp_path: Path) -> None:
    in_private_ns("a_slot_that_ran_nothing_keeps_its_root", tmp_path, __file__)


def test_a_pre_started_shell_is_kept_until_the_slot_runs_something(tmp_path: Path) -> None:
    in_private_ns("a_pre_started_shell_is_kept_until_the_slot_runs_something", tmp_path, __file__)


def test_a_forks_layer_is_let_go_and_not_killed_early(tmp_path: Path) -> None:
    in_private_ns("a_forks_layer_is_let_go_and_not_killed_early", tmp_path, __file__)


def test_a_slot_whose_root_was_never_built_is_reset_all_the_same(tmp_path: Path) -> None:
    in_private_ns("a_slot_whose_root_was_never_built_is_reset_all_the_same", tmp_path, __file__)


def test_a_slot_without_namespaces_has_its_uids_processes_and_tmp_files_purged(tmp_path: Path) -> None:
    in_private_ns("a_slot_without_namespaces_has_its_uids_processes_and_tmp_files_purged", tmp_path,
                  __file__, ("--pid", "--fork", "--mount-proc", "--ipc"))
