"""What a fresh slot's root costs the file system and the agent: layers placed apart on
ext4, and the user namespaces of idmapped mounts made without copying the agent.

- ``trees.spread_subdirs`` marks a directory ``chattr +T`` (ext2/3/4's Orlov allocator
  puts each new subdirectory in a block group of its choosing), so the inodes of one
  slot's layers are not made in the group where thousands were just freed (on ext4
  without a journal each new inode scans past those). The sandbox's state directory,
  its ``fs`` and every slot's layer directory once it has dropped a layer carry the
  mark; the slots' mount points (``mnt``) are on a tmpfs of the agent's.
- ``mounts.userns_fd`` makes its namespace with a ``clone(CLONE_VM | CLONE_NEWUSER)``
  child that shares the agent's memory: the namespace maps as the forked child's did,
  and nothing of the child is left (no process, no zombie, the caller's signal mask).
- A slot's template layer is the sandbox's shared one (``rootplan.SharedTemplate``, made
  once, root's) through an idmapped mount, with the slot's workspace in its layer; where
  that is refused, a template of the slot's own: the slot sees the same either way.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import agent_processes, bash, layered

from hermes_modal_tool.agent.fs import mounts, trees

pytestmark = pytest.mark.usefixtures("needs_root")


@pytest.fixture
def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("slots of their own uid, mounts and user namespaces need root")


def fs_type(path: str | Path) -> str:
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True,
                          text=True, check=True).stdout.strip()


def topdir(path: str | Path) -> bool:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, trees._GETFLAGS, flags, True)
        return bool(flags[0] & trees._TOPDIR_FL)
    finally:
        os.close(fd)


def agents_mounts_at(path: Path) -> set[str]:
    """File system types mounted at ``path`` in any agent's mount namespace."""
    out = set()
    for pid in agent_processes():
        for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            if left.split()[4] == str(path):
                out.add(right.split()[0])
    return out


def test_spread_subdirs_marks_ext4_and_leaves_other_file_systems(tmp_path: Path) -> None:
    if not fs_type(tmp_path).startswith("ext"):
        pytest.skip(f"{tmp_path} is not on ext2/3/4 here")
    d = tmp_path / "d"
    d.mkdir()
    assert not topdir(d)
    assert trees.spread_subdirs(d) is True
    assert topdir(d)
    assert trees.spread_subdirs(d) is True and topdir(d)  # again: unchanged
    (d / "child").mkdir()
    assert not topdir(d / "child")  # the mark is not inherited
    assert trees.spread_subdirs(tmp_path / "missing") is False
    link = tmp_path / "link"
    link.symlink_to(d)
    assert trees.spread_subdirs(link) is False  # never through a link
    shm = Path("/dev/shm")
    if fs_type(shm) == "tmpfs":
        assert trees.spread_subdirs(shm) is False  # tmpfs refuses it: nothing changes


async def test_the_sandbox_state_and_each_slots_layers_are_spread(make_backend) -> None:
    backend = await make_backend(slots_per_sandbox=2, min_sandboxes=1, max_sandboxes=1)
    if not layered(backend):
        pytest.skip("no layered root here")
    [sandbox] = next(iter(backend._pools.values()))._sandboxes.values()
    state = next(d for d in backend._drivers.values()).state_root / sandbox.sandbox_id
    if not fs_type(state).startswith("ext"):
        pytest.skip(f"the state directory {state} is not on ext2/3/4 here")
    slot = await backend.acquire("spread")
    r = await bash(backend, slot, "echo hi > /root/f && cat /root/f")
    assert r.output == "hi\n", r
    assert topdir(state) and topdir(state / "fs")
    assert "tmpfs" in agents_mounts_at(state / "mnt"), "the slots' mount points are not on a tmpfs"
    assert not os.listdir(state / "mnt")  # the host sees nothing of it
    base = state / "fs" / f"slot_{slot.index}"
    layers = [n for n in os.listdir(base) if n.startswith("layer-")]
    assert layers and not any(topdir(base / n) for n in layers)
    # Its first layers are made beside it (no scan of every block group); once it drops
    # one (a reset), each new layer is placed apart.
    assert not topdir(base)
    await backend.release(slot)
    for _ in range(100):
        if topdir(base):
            break
        await asyncio.sleep(0.05)
    assert topdir(base)


SHARED_CHILD = textwrap.dedent("""
    import os, signal, sys, tempfile
    from hermes_modal_tool.agent.fs import mounts
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    src, dst = tempfile.mkdtemp(), tempfile.mkdtemp()
    open(os.path.join(src, "f"), "w").close()
    os.chown(os.path.join(src, "f"), 0, 0)
    seen = []
    for make in (mounts._userns_fd_shared, mounts._userns_fd):  # shared child, then a fork
        ns = make(212345, 212346, 0)
        assert os.readlink("/proc/self/fd/%d" % ns) != os.readlink("/proc/self/ns/user")
        mounts.mount_idmapped(src, dst, ns)
        st = os.stat(os.path.join(dst, "f"))
        seen.append((st.st_uid, st.st_gid))
        mounts.umount(dst)
        os.close(ns)
    try:
        os.waitpid(-1, os.WNOHANG | mounts.WALL)
        left = "a child is left"
    except ChildProcessError:
        left = "no child"
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask, "signal mask changed"
    print(seen, left)
""")


def test_userns_from_a_shared_child_maps_like_a_fork_and_leaves_nothing() -> None:
    if not mounts._SHARED_OK[0]:
        pytest.skip("no shared-memory child on this machine (namespaces come from a fork)")
    # In a mount namespace of its own: the idmapped mount must not show on the host.
    r = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c",
                        SHARED_CHILD], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[(212345, 212346), (212345, 212346)] no child", r.stdout


def test_userns_fd_falls_back_to_a_fork_when_no_shared_child_can_be_made(monkeypatch) -> None:
    monkeypatch.setattr(mounts, "_SHARED_OK", [False])
    monkeypatch.setattr(mounts, "_USERNS_MAKER", [None])
    ns = mounts.userns_fd(212345, 212346)
    try:
        assert os.readlink(f"/proc/self/fd/{ns}") != os.readlink("/proc/self/ns/user")
    finally:
        os.close(ns)


SLOT_ROOTS = textwrap.dedent("""
    import os, stat, tempfile
    from hermes_modal_tool.agent.fs import mounts, rootfs, rootplan
    top = tempfile.mkdtemp()
    img = os.path.join(top, "img")
    for d in ("etc/apt/apt.conf.d", "srv", "tmp"):
        os.makedirs(os.path.join(img, d))
    tpl = os.path.join(top, "tpl")
    os.mkdir(tpl)
    mounts.mount_tmpfs(tpl, "size=1024k,mode=711")
    plan = rootplan.UpperPlan.for_image(img)
    shared = rootplan.SharedTemplate(os.path.join(tpl, "shared"), plan, ["/data", "/srv/work"])
    trash = os.path.join(top, "trash")
    os.mkdir(trash)
    out = []
    for i, uid in enumerate((212345, 212400)):
        if i == 1:
            shared.refuse("told to")  # slot 1 fills a template of its own
        root = rootfs.SlotRoot(os.path.join(top, "fs", "slot_%d" % i),
                               os.path.join(top, "mnt", "slot_%d" % i), uid, uid + 1, plan,
                               trash, ["/data/slot_%d" % i, "/srv/work"],
                               os.path.join(tpl, "slot_%d" % i), shared=shared)
        root.ensure()
        seen = {}
        for p in ("/data", "/data/slot_%d" % i, "/srv/work",
                  "/etc/apt/apt.conf.d/00hermes-modal-tool"):
            st = os.lstat(root.merged + p)
            seen[p.replace("slot_%d" % i, "slot_N")] = (
                stat.S_IMODE(st.st_mode), st.st_uid - uid, st.st_gid - uid - 1)
        with open("/proc/self/mountinfo") as fh:
            tpl_mount = [l.split()[3] for l in fh if " %s/tpl-0 " % root.lower in l]
        out.append((seen, os.listdir(root.merged + "/data"), tpl_mount,
                    os.path.isdir(os.path.join(tpl, "slot_%d" % i)),
                    os.path.isdir(os.path.join(root.active.dir, "upper", "data", "slot_%d" % i))))
        root.teardown()
    with open("/proc/self/mountinfo") as fh:
        left = [l for l in fh if "/tpl-0 " in l or "/merged " in l]
    print(repr((out, left)))
""")


def test_slots_share_one_template_through_idmapped_mounts_or_make_their_own() -> None:
    # In a mount namespace of its own, as the agent's: nothing of it shows on the host.
    r = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c",
                        SLOT_ROOTS], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    (shared, own), left = eval(r.stdout)  # noqa: S307 - our own script's repr
    want = {"/data": (0o755, 0, 0), "/data/slot_N": (0o755, 0, 0), "/srv/work": (0o755, 0, 0),
            "/etc/apt/apt.conf.d/00hermes-modal-tool": (0o644, 0, 0)}
    # The same view either way: every entry the slot's own (its root, in its namespace).
    assert shared[0] == own[0] == want
    assert shared[1] == ["slot_0"] and own[1] == ["slot_1"]  # no other slot's workspace
    # Slot 0: the shared template (its root-owned files in the tmpfs) through an idmapped
    # mount, no template of its own, its workspace in its layer. Slot 1: its own template.
    assert shared[2] == ["/shared/0"] and shared[3] is False and shared[4] is True
    assert own[2] == [] and own[3] is True and own[4] is False
    assert left == []
