"""The agent's side of a layered root's reset (agent/fs/rootfs.py), in process: no
sandbox starts (milliseconds a check; the mutation script runs these against every
mutant, confined).

A slot's root is an overlay of a writable layer over its template and an idmapped lower.
A reset drops the layer in use (``discard``: pointers only) and takes the standby one
(``swap``), or the next ``ensure`` builds one; the dropped layer is unmounted and moved
to the trash (``retire``), and the next standby is built in the background
(``prepare_standby``). Every verdict is taken on the file system: what the mount table
says is mounted, what the slot's ``/`` shows, what the trash holds, beside a positive
control (the last tenant's file was there, and is in the trash before it goes).

The mounts are real: each test's body runs in a child process in a mount namespace of its
own (``unshare -m --propagation private``), on a temporary image under pytest's
``tmp_path``; nothing of it shows on (or is mounted over) the host's paths, and all of it
vanishes with the child. The child is this file run as a script (:func:`main`); it loads
the agent's package alone, as a sandbox runs it (not the host package: a tenth of the
start-up time).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UID = GID = 212345  # the slot's uid (no user of this machine)
WS = "/workspace/slot_1"  # the slot's workspace in its view

if __name__ != "__main__":  # the child (main) needs no pytest
    import pytest

    pytestmark = pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("unshare") is None,
        reason="a layered root needs root (mounts) and unshare(1) for a private mount namespace")


def in_private_ns(body: str, tmp_path: Path, script: str = __file__, more: tuple = ()) -> None:
    """Run ``body_<body>(top)`` of ``script`` (this file) in a child in a private mount
    namespace (and the namespaces ``more`` asks unshare(1) for), ``top`` a new directory
    under ``tmp_path``; fail with the child's error."""
    top = tmp_path / "top"
    top.mkdir()
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run(["unshare", "-m", "--propagation", "private", *more, sys.executable, script,
                        body, str(top)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and r.stdout.endswith("passed\n"), r.stdout + r.stderr


# -- the child's side --------------------------------------------------------------------

def mount_points() -> set[str]:
    """The mount points of this (private) mount namespace."""
    with open("/proc/self/mountinfo") as fh:
        return {line.split()[4] for line in fh}


class Slot:
    """A slot's layered root on the image ``top/img`` (``/etc/image-file``, ``/srv``),
    with its trash and, optionally, a shared template, kept layer directories and layer
    file systems."""

    def __init__(self, top: str, shared: bool = False, spares: bool = False, disks=None,
                 mounts=("/",)) -> None:
        from hermes_modal_tool.agent.fs import layerspares, rootfs, rootplan
        from hermes_modal_tool.agent.fs import mounts as m

        assert os.path.dirname(rootfs.__file__) == str(ROOT / "hermes_modal_tool/agent/fs"), \
            rootfs.__file__  # the copy under test (a mutant's), not another install
        self.top = top
        img = os.path.join(top, "img")
        for d in ("etc/apt/apt.conf.d", "srv", "workspace"):
            os.makedirs(os.path.join(img, d))
        with open(os.path.join(img, "etc", "image-file"), "w") as fh:
            fh.write("from the image\n")
        with open(os.path.join(img, "srv", "image-srv"), "w") as fh:
            fh.write("srv of the image\n")
        self.plan = rootplan.UpperPlan.for_image(img)
        self.plan.mounts = list(mounts)  # ("/", "/srv"): a separately mounted top directory
        tpl = os.path.join(top, "tpl")
        os.mkdir(tpl)
        m.mount_tmpfs(tpl, "size=1024k,mode=711")  # the sandbox's small tmpfs
        self.trash = os.path.join(top, "trash")
        os.mkdir(self.trash, 0o700)
        template = None
        if shared:
            template = rootplan.SharedTemplate(os.path.join(tpl, "shared"), self.plan, ["/workspace"])
        self.spares = None
        if spares:
            os.mkdir(os.path.join(top, "spares"), 0o700)
            self.spares = layerspares.LayerSpares(os.path.join(top, "spares"))
        self.base = os.path.join(top, "fs", "slot_1")
        self.root = rootfs.SlotRoot(self.base, os.path.join(top, "mnt", "slot_1"), UID, GID,
                                    self.plan, self.trash, [WS], os.path.join(tpl, "slot_1"),
                                    self.spares, template)
        self.root.disks = disks

    def tenant_writes(self) -> None:
        """What a tenant leaves in its root (through the overlay: into its layer)."""
        merged = self.root.merged
        with open(merged + "/etc/tenant", "w") as fh:
            fh.write("the last tenant's\n")
        with open(merged + WS + "/notes", "w") as fh:
            fh.write("notes\n")
        assert os.path.exists(merged + "/etc/tenant")  # positive control

    def fresh(self, layer) -> None:
        """``layer`` is mounted as the slot's root, fresh: the image and the workspace,
        nothing of a tenant; its directory and upper the slot's."""
        assert layer is not None and layer.mounted == [layer.merged] + [
            layer.merged + mount for mount in self.plan.mounts if mount != "/"], layer.mounted
        assert layer.merged in mount_points()
        with open(layer.merged + "/etc/image-file") as fh:
            assert fh.read() == "from the image\n"
        assert os.path.isdir(layer.merged + WS)
        assert not os.path.exists(layer.merged + "/etc/tenant")
        assert os.listdir(layer.merged + WS) == []
        st = os.stat(layer.dir)
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (UID, GID, 0o700)
        for i in range(len(self.plan.mounts)):
            upper, work = layer.dirs(i)
            assert (os.stat(upper).st_uid, os.stat(work).st_mode & 0o777) == (UID, 0o700)

    def layers(self) -> list[str]:
        return sorted(n for n in os.listdir(self.base) if n.startswith("layer-"))


def body_first_root_then_a_reset_through_the_standby(top: str) -> None:
    s = Slot(top)
    root = s.root
    assert root.prepare_standby() is None and not os.path.exists(s.base)  # no lowers yet: nothing
    assert root.swap() is False and root.merged == os.path.join(s.base, "none")
    assert root.ensure() is True and root.mounted
    first = root.active
    s.fresh(first)
    assert root.merged == first.merged == os.path.join(s.base, "layer-1", "merged")
    assert root.ensure() is False and root.swap() is True and root.active is first  # kept
    s.tenant_writes()
    root.prepare_standby()  # the next tenant's, built in the background
    standby = root.standby
    s.fresh(standby)
    assert standby is not first and root.active is first
    root.prepare_standby()  # one is ready: nothing more
    assert root.standby is standby and s.layers() == ["layer-1", "layer-2"]
    # A fork of this slot finds its root's read-only view mounted already.
    assert os.path.join(s.top, "mnt", "slot_1", "view-0") in mount_points()
    # The layer in use stays in use while a standby is ready.
    assert root.ensure() is False and root.swap() is True
    assert root.active is first and root.standby is standby
    # The reset: pointers only.
    old = root.discard()
    assert old is first and root.active is None and not root.mounted
    assert root.discard() is None
    assert first.merged in mount_points()  # dropped, not yet unmounted (retire does)
    assert root.swap() is True and root.active is standby and root.standby is None
    assert root.merged == standby.merged
    assert not os.path.exists(root.merged + "/etc/tenant")
    # Retired: unmounted, moved to the trash with what the tenant wrote.
    dest = root.retire(old)
    assert dest == os.path.join(s.trash, "slot_1-layer-1")
    assert first.merged not in mount_points() and old.mounted == []
    with open(os.path.join(dest, "upper", "etc", "tenant")) as fh:
        assert fh.read() == "the last tenant's\n"
    assert os.stat(os.path.join(dest, "merged")).st_mode & 0o777 == 0o755  # the mount point
    assert s.layers() == ["layer-2"]
    s.fresh(root.active)  # the new tenant's root is untouched by the retirement
    # The next reset without a standby: swap finds none, ensure builds one.
    old = root.discard()
    assert root.swap() is False and root.active is None
    assert root.ensure() is True
    s.fresh(root.active)
    assert root.active.dir == os.path.join(s.base, "layer-3")
    root.retire(old)
    assert old.merged not in mount_points()
    root.teardown()


def body_a_standby_is_kept_when_the_roots_view_cannot_be_mounted(top: str) -> None:
    s = Slot(top)
    root = s.root
    root.ensure()
    view = os.path.join(s.top, "mnt", "slot_1", "view-0")
    with open(view, "w"):  # in the way of the view's mount point
        pass
    root.prepare_standby()  # a fork of this slot tries again and says why it cannot
    s.fresh(root.standby)
    assert view not in mount_points()
    root.teardown()


def body_a_forks_layer_is_reset_with_its_lower_mounts(top: str) -> None:
    s = Slot(top)
    root = s.root
    root.ensure()
    s.tenant_writes()
    frozen = root.freeze()  # a snapshot of the tenant's layer (another slot's: idmapped)
    fork = root.build_on([(frozen.dir, UID + 1)])
    assert root.install(fork) is None
    with open(root.merged + "/etc/tenant") as fh:  # positive control: the frozen layer shows
        assert fh.read() == "the last tenant's\n"
    inside = [p for p in mount_points() if p.startswith(fork.dir + "/")]
    assert sorted(inside) == sorted([fork.merged] + fork.lower_mounts) and fork.lower_mounts, inside
    dest = root.retire(root.discard())
    left = [p for p in mount_points() if p.startswith((fork.dir + "/", dest + "/"))]
    assert left == [] and fork.lower_mounts == [] and fork.mounted == [], left
    assert os.path.isfile(os.path.join(frozen.dir, "upper", "etc", "tenant"))  # the snapshot's
    root.teardown()


def body_current_points_at_the_layer_in_use(top: str) -> None:
    s = Slot(top)
    root = s.root
    link = os.path.join(s.base, "current")
    root.point_current()
    assert not os.path.lexists(link)  # nothing in use: nothing to point at
    root.ensure()
    root.point_current()
    assert os.readlink(link) == "layer-1"
    root.prepare_standby()
    root.retire(root.discard())
    root.point_current()  # none in use: left as it was
    assert os.readlink(link) == "layer-1"
    os.symlink("stale", link + ".new")  # left by an interrupted update
    root.swap()
    root.point_current()
    assert os.readlink(link) == "layer-2" and not os.path.lexists(link + ".new")
    root.teardown()


def body_the_first_retirement_spreads_the_slots_next_layers(top: str) -> None:
    from hermes_modal_tool.agent.fs import trees

    probe = os.path.join(top, "probe")
    os.mkdir(probe)
    if not trees.spread_subdirs(probe):
        print("this file system has no Orlov hint (not ext4): passed")
        return
    s = Slot(top)
    root = s.root
    root.ensure()
    assert not _topdir(s.base)  # positive control: not marked before
    root.prepare_standby()
    root.retire(root.discard())
    assert _topdir(s.base)
    root.teardown()


def _topdir(path: str) -> bool:
    import array
    import fcntl

    from hermes_modal_tool.agent.fs import trees

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, trees._GETFLAGS, flags, True)
        return bool(flags[0] & trees._TOPDIR_FL)
    finally:
        os.close(fd)


def body_layers_built_at_once_one_kept_the_other_standby_or_retired(top: str) -> None:
    s = Slot(top)
    root = s.root
    build = root._build
    meet = threading.Barrier(2, timeout=20)

    def both_built():  # two threads build at once, then both reach the pointers
        layer = build()
        meet.wait()
        return layer

    root._build = both_built
    got = []
    threads = [threading.Thread(target=lambda: got.append(root.ensure())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [True, True]
    active, standby = root.active, root.standby
    assert active is not None and standby is not None and active is not standby
    s.fresh(active)
    s.fresh(standby)  # the loser of the race is kept for the next tenant
    # Now two standby builds at once: one is kept, the other retired (unmounted, trashed).
    root.discard()
    root.swap()
    assert root.standby is None
    meet.reset()
    threads = [threading.Thread(target=root.prepare_standby) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kept = root.standby
    s.fresh(kept)
    assert sorted(os.listdir(s.trash)) == ["slot_1-layer-4"] or sorted(os.listdir(s.trash)) == [
        "slot_1-layer-3"], os.listdir(s.trash)
    [gone] = os.listdir(s.trash)
    assert kept.dir != os.path.join(s.base, gone.split("-", 1)[1])
    assert os.path.join(s.base, gone.split("-", 1)[1], "merged") not in mount_points()
    assert os.path.join(s.base, gone.split("-", 1)[1]) not in [os.path.join(s.base, n) for n in s.layers()]
    root.teardown()


def body_a_shared_template_and_the_slots_own_workspace_in_each_layer(top: str) -> None:
    s = Slot(top, shared=True)
    root = s.root
    root.ensure()
    s.fresh(root.active)
    assert os.path.isdir(os.path.join(root.active.dir, "upper", WS.lstrip("/")))  # the slot's own
    assert not os.path.exists(os.path.join(top, "tpl", "slot_1"))  # no template of its own
    s.tenant_writes()
    root.prepare_standby()
    old = root.discard()
    root.swap()
    s.fresh(root.active)
    assert os.path.isdir(os.path.join(root.active.dir, "upper", WS.lstrip("/")))
    root.retire(old)
    root.teardown()


def body_kept_layer_directories_are_reused_without_the_tenants_files(top: str) -> None:
    s = Slot(top, spares=True)
    root = s.root
    root.ensure()
    s.tenant_writes()
    first_ino = os.stat(root.active.dir).st_ino
    root.prepare_standby()
    old = root.discard()
    root.swap()
    dest = root.retire(old)
    assert os.path.exists(os.path.join(dest, "upper", "etc", "tenant"))  # positive control
    assert s.spares.keep(dest) and len(s.spares) == 1
    root.retire(root.discard())  # the next reset without a standby: ensure builds one
    assert root.ensure() is True
    layer = root.active
    assert os.stat(layer.dir).st_ino == first_ino and len(s.spares) == 0  # the kept one
    s.fresh(layer)
    assert not os.path.exists(os.path.join(layer.dir, "upper", "etc"))
    root.teardown()


def body_a_root_of_two_mounts_is_reset_whole(top: str) -> None:
    s = Slot(top, mounts=("/", "/srv"))
    root = s.root
    root.ensure()
    s.fresh(root.active)
    first = root.active
    with open(first.merged + "/srv/image-srv") as fh:
        assert fh.read() == "srv of the image\n"
    with open(first.merged + "/srv/tenant-srv", "w") as fh:
        fh.write("x")
    assert os.path.exists(os.path.join(first.dir, "layers", "1", "upper", "tenant-srv"))
    assert os.stat(os.path.join(first.dir, "layers", "1")).st_mode & 0o777 == 0o700
    root.prepare_standby()
    root.discard()
    root.swap()
    s.fresh(root.active)
    assert not os.path.exists(root.merged + "/srv/tenant-srv")
    dest = root.retire(first)
    assert first.merged not in mount_points() and first.merged + "/srv" not in mount_points()
    assert os.path.exists(os.path.join(dest, "layers", "1", "upper", "tenant-srv"))
    root.teardown()


class TmpfsDisks:
    """Layer file systems as :class:`.slotdisk.LayerDisks` hands them out (``attach``: a
    detached mount's descriptor, its root owned by the slot, mode 0700; ``release``), each
    a small tmpfs instead of a loop-mounted ext4 image (no loop devices in a confined run)."""

    def __init__(self, top: str) -> None:
        self.at = os.path.join(top, "disk-mnt")
        os.mkdir(self.at)
        self.held: set[int] = set()
        self.released: list[int] = []

    def attach(self, uid: int = 0, gid: int = 0) -> int:
        from hermes_modal_tool.agent.fs import mounts

        mounts.mount_tmpfs(self.at, "size=1024k,mode=700")
        try:
            mfd = mounts.clone_tree(self.at)
        finally:
            mounts.umount(self.at)
        os.chown(f"/proc/self/fd/{mfd}", uid, gid)
        self.held.add(mfd)
        return mfd

    def release(self, mfd: int) -> None:
        self.held.discard(mfd)
        self.released.append(mfd)
        os.close(mfd)


def body_layers_on_file_systems_of_their_own_are_let_go(top: str) -> None:
    disks = TmpfsDisks(top)
    s = Slot(top, disks=disks)
    root = s.root
    root.ensure()
    first = root.active
    s.fresh(first)
    assert first.disk in disks.held and first.dirs(0)[0] == f"/proc/self/fd/{first.disk}/upper"
    s.tenant_writes()
    assert os.listdir(f"/proc/self/fd/{first.disk}/upper/etc") == ["tenant"]  # on its disk
    assert not os.path.exists(os.path.join(first.dir, "upper"))
    disk = first.disk
    root.prepare_standby()
    old = root.discard()
    root.swap()
    s.fresh(root.active)
    assert root.retire(old) is None  # nothing to delete: the kernel frees its file system
    assert disks.released == [disk] and old.disk is None and disk not in disks.held
    assert not os.path.exists(first.dir) and os.listdir(s.trash) == []
    assert first.merged not in mount_points()
    # A build that fails lets its file system go and leaves no directory.
    shutil.rmtree(os.path.join(top, "tpl", "slot_1", "0"))  # its template: the mount fails
    before = s.layers()
    try:
        root.prepare_standby()
    except OSError:
        pass
    else:
        raise AssertionError("the overlay mount on a missing template did not fail")
    assert root.standby is None and s.layers() == before
    assert len(disks.released) == 2 and disks.held == {root.active.disk}
    root.teardown()


def body_a_failed_build_leaves_nothing(top: str) -> None:
    s = Slot(top, mounts=("/", "/srv"))
    root = s.root
    root.ensure()
    s.fresh(root.active)
    shutil.rmtree(os.path.join(top, "tpl", "slot_1", "1"))  # /srv's template: its mount fails
    before = mount_points()
    try:
        root.ensure() or root.prepare_standby()
    except OSError:
        pass
    else:
        raise AssertionError("the overlay mount on a missing template did not fail")
    assert root.standby is None and s.layers() == ["layer-1"]
    assert mount_points() == before  # the first mount of the failed layer is undone
    root.teardown()


def main(bodies: dict | None = None) -> None:
    """The child: ``body_<argv[1]>(argv[2])`` of ``bodies`` (this module's globals)."""
    name, top = sys.argv[1], sys.argv[2]
    # The agent's package of this tree (a mutant's copy), without the host package's
    # __init__ (the agent is stdlib-only: it runs in a sandbox that way).
    host = types.ModuleType("hermes_modal_tool")
    host.__path__ = [str(ROOT / "hermes_modal_tool")]
    sys.modules["hermes_modal_tool"] = host
    (bodies or globals())["body_" + name](top)
    print("passed")


if __name__ == "__main__":
    main()


# -- the tests ---------------------------------------------------------------------------

def test_first_root_then_a_reset_through_the_standby(tmp_path: Path) -> None:
    in_private_ns("first_root_then_a_reset_through_the_standby", tmp_path)


def test_a_standby_is_kept_when_the_roots_view_cannot_be_mounted(tmp_path: Path) -> None:
    in_private_ns("a_standby_is_kept_when_the_roots_view_cannot_be_mounted", tmp_path)


def test_a_forks_layer_is_reset_with_its_lower_mounts(tmp_path: Path) -> None:
    in_private_ns("a_forks_layer_is_reset_with_its_lower_mounts", tmp_path)


def test_current_points_at_the_layer_in_use(tmp_path: Path) -> None:
    in_private_ns("current_points_at_the_layer_in_use", tmp_path)


def test_the_first_retirement_spreads_the_slots_next_layers(tmp_path: Path) -> None:
    in_private_ns("the_first_retirement_spreads_the_slots_next_layers", tmp_path)


def test_layers_built_at_once_one_kept_the_other_standby_or_retired(tmp_path: Path) -> None:
    in_private_ns("layers_built_at_once_one_kept_the_other_standby_or_retired", tmp_path)


def test_a_shared_template_and_the_slots_own_workspace_in_each_layer(tmp_path: Path) -> None:
    in_private_ns("a_shared_template_and_the_slots_own_workspace_in_each_layer", tmp_path)


def test_kept_layer_directories_are_reused_without_the_tenants_files(tmp_path: Path) -> None:
    in_private_ns("kept_layer_directories_are_reused_without_the_tenants_files", tmp_path)


def test_a_root_of_two_mounts_is_reset_whole(tmp_path: Path) -> None:
    in_private_ns("a_root_of_two_mounts_is_reset_whole", tmp_path)


def test_layers_on_file_systems_of_their_own_are_let_go(tmp_path: Path) -> None:
    in_private_ns("layers_on_file_systems_of_their_own_are_let_go", tmp_path)


def test_a_failed_build_leaves_nothing(tmp_path: Path) -> None:
    in_private_ns("a_failed_build_leaves_nothing", tmp_path)
