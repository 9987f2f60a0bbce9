"""What a slot's layered root hides: root-only host files, except where the slot sees an
empty directory anyway (a whiteout there used to break every shell start); and the
template every slot's root starts from, worked out once and replayed per slot, or made
once for all slots (owned by root) when every entry is root's."""

import os
import stat
from pathlib import Path

import pytest

from hermes_modal_tool.agent.fs import rootplan
from hermes_modal_tool.drivers import _rootmask


def test_paths_under_emptied_directories_need_no_whiteout(tmp_path):
    hidden = rootplan.hidden_paths(
        [], ["/var/tmp/build/work/work", "/tmp/x", "/root/.ssh", "/etc/shadow", "/var/tmp"],
        nonstandard_top=False)
    assert hidden == (["/etc/shadow"] if os.path.lexists("/etc/shadow") else [])


def test_under_empty_dir_names_the_directory_and_below_only():
    assert rootplan.under_empty_dir("/var/tmp")
    assert rootplan.under_empty_dir("/var/tmp/a/b")
    assert not rootplan.under_empty_dir("/var/tmpfoo")
    assert not rootplan.under_empty_dir("/var/cache/x")


def test_scan_does_not_enter_an_emptied_directory(tmp_path, monkeypatch):
    tree = tmp_path / "var"
    (tree / "tmp" / "job").mkdir(parents=True)
    (tree / "cache").mkdir()
    for path in (tree / "tmp" / "job" / "secret", tree / "cache" / "secret"):
        path.write_text("x")
        path.chmod(0o600)
    monkeypatch.setattr(rootplan, "EMPTY_DIRS", {str(tree / "tmp"): 0o1777})
    found = _rootmask._scan((str(tree),))
    assert found == [str(tree / "cache" / "secret")]


def _tree(top):
    out = {}
    for d, ds, fs in os.walk(top):
        for n in ds + fs:
            p = os.path.join(d, n)
            st = os.lstat(p)
            try:
                opaque = os.getxattr(p, rootplan.OPAQUE, follow_symlinks=False)
            except OSError:
                opaque = None
            out["/" + os.path.relpath(p, top)] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode),
                                                  st.st_uid, st.st_gid, st.st_rdev, opaque)
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="a template is chowned to the slot's ids: root only")
def test_apply_makes_the_template_from_ops_worked_out_once(tmp_path):
    # The host's /etc/shadow and a top-level directory the host has: whiteouts; /root,
    # /tmp ...: emptied (opaque, the slot's); the slot's workspace: made with its parents.
    plan = rootplan.UpperPlan(["/etc/shadow", "/var/lib/dpkg"], [], False)
    ops = plan.template_ops()
    assert plan.template_ops() is ops  # worked out once, replayed per slot
    trees = []
    for i, ids in enumerate(((201234, 201235), (205000, 205001))):
        upper = tmp_path / f"t{i}"
        upper.mkdir()
        plan.apply({"/": str(upper)}, *ids, dirs=["/data/slot_3/work"])
        trees.append((_tree(upper), ids))
    (t0, (uid, gid)), (t1, ids1) = trees

    def same_ids(t, ids):  # the slot's ids stand for "slot"; other owners stay as they are
        m = {ids[0]: "slot", ids[1]: "slot"}
        return {p: v[:2] + (m.get(v[2], v[2]), m.get(v[3], v[3])) + v[4:] for p, v in t.items()}
    assert same_ids(t0, (uid, gid)) == same_ids(t1, ids1)
    for path, mode in rootplan.EMPTY_DIRS.items():
        if os.path.isdir(path):
            assert t0[path] == (stat.S_IFDIR, mode, uid, gid, 0, b"y"), path
    assert t0["/etc/shadow"] == (stat.S_IFCHR, 0, 0, 0, os.makedev(0, 0), None)
    assert t0["/var/lib/dpkg"][0] == stat.S_IFCHR
    for parent in ("/etc", "/var", "/var/lib"):  # the lower's mode; root's owner is the slot
        st = os.lstat(parent)
        want = (uid if st.st_uid == 0 else st.st_uid, gid if st.st_gid == 0 else st.st_gid)
        assert t0[parent][:4] == (stat.S_IFDIR, stat.S_IMODE(st.st_mode)) + want, parent
    assert t0["/data/slot_3/work"][:4] == (stat.S_IFDIR, 0o755, uid, gid)
    if os.path.isdir("/etc/apt/apt.conf.d"):
        conf = tmp_path / "t0" / rootplan.APT_CONF[0]
        assert conf.read_bytes() == rootplan.APT_CONF[1] and conf.stat().st_uid == uid


def _image(root, owner=0):
    """A small image root: ``/etc/apt/apt.conf.d`` and ``/srv`` owned by ``owner``."""
    (root / "etc" / "apt" / "apt.conf.d").mkdir(parents=True)
    (root / "srv").mkdir()
    os.chown(root / "srv", owner, owner)
    return rootplan.UpperPlan.for_image(str(root))


@pytest.mark.skipif(os.geteuid() != 0, reason="the shared template is root's: root only")
def test_shared_template_is_made_once_owned_by_root(tmp_path):
    plan = _image(tmp_path / "img")
    shared = rootplan.SharedTemplate(str(tmp_path / "tpl"), plan, ["/data", "/srv/work", None, "/"])
    assert shared.dirs == ["/data", "/srv/work"]
    tops = shared.tops()
    assert shared.tops() is tops and tops == [str(tmp_path / "tpl" / "0")]
    tree = _tree(Path(tops[0]))
    assert {p: v[2:4] for p, v in tree.items()} == {p: (0, 0) for p in tree}  # root's, all
    assert tree["/data"][:2] == (stat.S_IFDIR, 0o755) and tree["/srv/work"][:2] == (stat.S_IFDIR, 0o755)
    conf = Path(tops[0]) / rootplan.APT_CONF[0]
    assert conf.read_bytes() == rootplan.APT_CONF[1]
    assert shared.broken is None


@pytest.mark.skipif(os.geteuid() != 0, reason="the shared template is root's: root only")
def test_shared_template_refuses_an_entry_of_another_owner(tmp_path):
    # /srv is 1234's in the image: a one-id mapping cannot show its copy as it is.
    plan = _image(tmp_path / "img", owner=1234)
    shared = rootplan.SharedTemplate(str(tmp_path / "tpl"), plan, ["/srv/work"])
    with pytest.raises(OSError, match="owned by 1234:1234"):
        shared.tops()
    assert "owned by 1234:1234" in shared.broken
    with pytest.raises(OSError, match="owned by 1234"):  # and stays refused
        shared.tops()
    shared = rootplan.SharedTemplate(str(tmp_path / "tpl2"), _image(tmp_path / "img2"), [])
    shared.refuse("an idmapped mount of it failed: EINVAL")
    with pytest.raises(OSError, match="idmapped mount of it failed"):
        shared.tops()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to a slot's ids: root only")
def test_add_dirs_gives_each_layer_the_roots_modes_worked_out_once(tmp_path):
    # A group-shared /srv (set-group-id, group 50), a sticky world-writable /pub and a
    # 0777 /open: what mkdir alone cannot give (the set-id and sticky bits, bits the
    # umask clears, a bit inherited from a set-group-id parent) is set by chmod.
    root = tmp_path / "img"
    for name, mode, group in (("srv", 0o2775, 50), ("pub", 0o1777, 0), ("open", 0o777, 0)):
        (root / name).mkdir(parents=True)
        os.chown(root / name, 0, group)
        os.chmod(root / name, mode)
    plan = rootplan.UpperPlan.for_image(str(root))
    dirs = ["/srv/ws/slot_1", "/pub/a", "/open/b", "/srv/ws", "", "/"]
    ops = plan.dir_ops(dirs)
    assert plan.dir_ops(dirs) is ops  # worked out once per list, replayed per layer
    assert [op[1] for op in ops] == ["/srv", "/srv/ws", "/srv/ws/slot_1", "/pub", "/pub/a",
                                     "/open", "/open/b"]
    uid, gid = 203000, 203001
    for i in range(2):
        upper = tmp_path / f"upper{i}"
        upper.mkdir(mode=0o755)
        plan.add_dirs({"/": str(upper)}, uid, gid, dirs)
        got = {p: (stat.S_IMODE(os.lstat(f"{upper}{p}").st_mode), os.lstat(f"{upper}{p}").st_uid,
                   os.lstat(f"{upper}{p}").st_gid) for p in [op[1] for op in ops]}
        assert got == {"/srv": (0o2775, uid, 50), "/srv/ws": (0o755, uid, gid),
                       "/srv/ws/slot_1": (0o755, uid, gid), "/pub": (0o1777, uid, gid),
                       "/pub/a": (0o755, uid, gid), "/open": (0o777, uid, gid),
                       "/open/b": (0o755, uid, gid)}
    # Already there: kept as it is; something else in the way: an error naming it.
    plan.add_dirs({"/": str(tmp_path / "upper0")}, uid, gid, dirs)
    blocked = tmp_path / "upper2"
    (blocked / "srv").mkdir(parents=True)
    (blocked / "srv" / "ws").write_text("")
    with pytest.raises(FileExistsError, match="ws"):
        plan.add_dirs({"/": str(blocked)}, uid, gid, dirs)
