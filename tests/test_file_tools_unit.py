"""The agent's path resolution (agent/files/files.py ``Workspace``) on a real directory tree, in
process (milliseconds a test: the mutation script runs these against every mutant).

Both layouts: workspace-only (``Workspace(ws, "/data/slot_1")``: absolute paths must be
under the workspace, links must stay inside it) and a whole root (``Workspace(root, "/",
cwd=...)``: absolute paths and absolute link targets resolve inside ``root``, ``..`` stops
at it). Beside the tree, on the host, is a canary each test must never read or change;
each refusal sits beside the same operation succeeding on a file inside.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hermes_modal_tool.agent.files.files import FileToolError, Workspace

TOKEN = "outside-canary"


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """``root`` (a slot's root: etc/, data/slot_1 with files) and ``outside`` (the host's
    files beside it, with a canary); links in the workspace point out every way."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary").write_text(TOKEN)
    root = tmp_path / "root"
    ws = root / "data" / "slot_1"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "conf").write_text("in-root")
    ws.mkdir(parents=True)
    (ws / "mine.txt").write_text("mine")
    (ws / "sub").mkdir()
    (ws / "sub" / "deep.txt").write_text("deep")
    os.symlink(str(outside), ws / "abs_out")  # an absolute link to a host directory
    os.symlink(str(outside / "canary"), ws / "abs_file")
    os.symlink("../../../../outside", ws / "rel_out")  # climbs out of the root
    os.symlink("/etc", ws / "abs_etc")  # the slot's /etc in a whole root
    os.symlink("/data/slot_1/sub", ws / "abs_in")  # inside the workspace, absolute
    os.symlink("sub/deep.txt", ws / "rel_in")
    os.symlink("loop_b", ws / "loop_a")
    os.symlink("loop_a", ws / "loop_b")
    return {"root": root, "ws": ws, "outside": outside}


def ws_only(tree: dict[str, Path]) -> Workspace:
    return Workspace(str(tree["ws"]), "/data/slot_1")


def rooted(tree: dict[str, Path]) -> Workspace:
    return Workspace(str(tree["root"]), "/", cwd="/data/slot_1")


def read(w: Workspace, path: str) -> bytes:
    return w.read_bytes(path)[0]


def intact(tree: dict[str, Path]) -> None:
    assert sorted(p.name for p in tree["outside"].iterdir()) == ["canary"]
    assert (tree["outside"] / "canary").read_text() == TOKEN


@pytest.mark.parametrize("layout", [ws_only, rooted])
def test_inside_paths_resolve(tree, layout) -> None:
    w = layout(tree)
    assert read(w, "mine.txt") == b"mine" and read(w, "/data/slot_1/mine.txt") == b"mine"
    assert read(w, "./sub/../mine.txt") == b"mine" and read(w, "sub//deep.txt") == b"deep"
    assert read(w, "rel_in") == b"deep" and read(w, "abs_in/deep.txt") == b"deep"
    _, _, shown = w.read_bytes("sub/deep.txt")
    assert shown == "/data/slot_1/sub/deep.txt"
    assert w.read_bytes("mine.txt", offset=1, limit=2)[0] == b"in"


def test_workspace_only_refuses_every_way_out(tree) -> None:
    w = ws_only(tree)
    out = tree["outside"]
    cases = {"/etc/conf": "path '/etc/conf' is outside the workspace /data/slot_1; use a relative path",
             "/data/slot_10/x": "path '/data/slot_10/x' is outside the workspace /data/slot_1",
             "../slot_1/mine.txt": "path '../slot_1/mine.txt' escapes the workspace",
             "sub/../../x": "path 'sub/../../x' escapes the workspace",
             "abs_out/canary": f"path 'abs_out/canary' goes through a symbolic link to {out}, outside",
             "abs_file": f"path 'abs_file' goes through a symbolic link to {out}/canary, outside",
             "abs_etc/conf": "path 'abs_etc/conf' goes through a symbolic link to /etc, outside",
             "rel_out/canary": "path 'rel_out/canary' escapes the workspace",
             "loop_a": "too many symbolic links in 'loop_a'",
             "mine.txt/x": "not a directory: /data/slot_1/mine.txt",
             "nope/x": "no such directory: /data/slot_1/nope", "nope": "no such file: /data/slot_1/nope"}
    for path, message in cases.items():
        with pytest.raises(FileToolError) as err:
            read(w, path)
        assert str(err.value).startswith(message), (path, str(err.value))
        if not path.startswith("nope"):  # (a write makes missing parents and the file)
            with pytest.raises(FileToolError) as err:
                w.write_bytes(path, b"pwned")
            assert str(err.value).startswith(message), (path, str(err.value))
    with pytest.raises(FileToolError, match="outside the workspace"):
        w.list_dir("/etc")
    intact(tree)


def test_a_whole_root_resolves_absolute_links_and_dotdot_inside_it(tree) -> None:
    w = rooted(tree)
    assert read(w, "/etc/conf") == b"in-root" and read(w, "abs_etc/conf") == b"in-root"
    assert read(w, "/../../../etc/conf") == b"in-root"  # ".." of "/" is "/"
    assert read(w, "sub/../../../../../etc/conf") == b"in-root"
    for path in ("abs_out/canary", "abs_file", "rel_out/canary", str(tree["outside"] / "canary")):
        with pytest.raises(FileToolError, match="no such"):
            read(w, path)
    # A write through a link to a host path lands in the root (its own copy), never outside.
    assert w.write_bytes("abs_file", b"pwned") == str(tree["outside"] / "canary")
    assert (tree["root"] / str(tree["outside"] / "canary").lstrip("/")).read_bytes() == b"pwned"
    assert w.write_bytes("rel_out/new", b"pwned") == "/outside/new"
    assert (tree["root"] / "outside" / "new").read_bytes() == b"pwned"
    intact(tree)


@pytest.mark.parametrize("layout", [ws_only, rooted])
def test_write_creates_appends_truncates_and_refuses_non_files(tree, layout) -> None:
    w = layout(tree)
    assert w.write_bytes("new/dir/f.txt", b"one") == "/data/slot_1/new/dir/f.txt"
    assert w.write_bytes("new/dir/f.txt", b"+two", append=True) and read(w, "new/dir/f.txt") == b"one+two"
    assert w.write_bytes("new/dir/f.txt", b"3") and read(w, "new/dir/f.txt") == b"3"
    assert (tree["ws"] / "new" / "dir").stat().st_mode & 0o777 == 0o755
    w.write_bytes("rel_in", b"via-link")  # a link inside: followed
    assert (tree["ws"] / "sub" / "deep.txt").read_bytes() == b"via-link"
    os.mkfifo(tree["ws"] / "fifo")
    for path, message in (("fifo", "/data/slot_1/fifo is not a regular file"),
                          ("sub", "/data/slot_1/sub is a directory"), (".", "/data/slot_1 is a directory")):
        with pytest.raises(FileToolError) as err:
            w.write_bytes(path, b"x")
        assert str(err.value) == message, (path, str(err.value))
        with pytest.raises(FileToolError) as err:
            read(w, path)
        assert str(err.value) == message, (path, str(err.value))
    if os.geteuid() == 0:  # a device node (root may make one): opened for writing, then refused
        os.mknod(tree["ws"] / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        with pytest.raises(FileToolError) as err:
            w.write_bytes("null", b"x")
        assert str(err.value) == "/data/slot_1/null is not a regular file"
        with pytest.raises(FileToolError) as err:
            read(w, "null")
        assert str(err.value) == "/data/slot_1/null is not a regular file"
    for bad, message in (("a\x00b", "path contains a NUL byte: 'a\\x00b'"), (7, "path must be a string, got int")):
        with pytest.raises(FileToolError) as err:
            read(w, bad)
        assert str(err.value) == message


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a file of another owner needs root")
@pytest.mark.parametrize("layout", [ws_only, rooted])
def test_a_file_of_another_owner_is_refused_and_a_hard_link_to_it_too(tree, layout) -> None:
    w = layout(tree)
    w.uid, w.gid = os.getuid(), os.getgid()
    foreign = tree["ws"] / "foreign"
    foreign.write_text("foreign")
    os.chown(foreign, 12345, 12345)
    os.link(foreign, tree["ws"] / "hard")
    for path in ("foreign", "hard"):
        with pytest.raises(FileToolError, match="not owned by this slot"):
            read(w, path)
        with pytest.raises(FileToolError, match="not owned by this slot"):
            w.write_bytes(path, b"pwned", append=True)
    assert foreign.read_text() == "foreign"
    # Positive control: a file of its own owner reads and is written (and stays its own).
    assert read(w, "mine.txt") == b"mine"
    w.write_bytes("made.txt", b"x")
    assert (tree["ws"] / "made.txt").stat().st_uid == os.getuid()


@pytest.mark.parametrize("layout", [ws_only, rooted])
def test_walk_keeps_a_final_link_when_asked(tree, layout) -> None:
    w = layout(tree)
    dir_fd, name, shown = w.walk("abs_file", follow_last=False)
    try:
        assert name == "abs_file" and shown == "/data/slot_1/abs_file"
        assert os.readlink(name, dir_fd=dir_fd) == str(tree["outside"] / "canary")
    finally:
        os.close(dir_fd)
    dir_fd, name, shown = w.walk("/data/slot_1")
    os.close(dir_fd)
    assert shown == "/data/slot_1"


@pytest.mark.parametrize("layout", [ws_only, rooted])
def test_listing_stays_inside(tree, layout) -> None:
    w = layout(tree)
    entries, truncated, shown = w.list_dir(".", recursive=True)
    names = {e["path"] for e in entries}
    assert {"mine.txt", "sub/deep.txt", "abs_out"} <= names and not truncated
    assert not any("canary" in n for n in names)
    entries, truncated, _ = w.list_dir(".", recursive=True, max_entries=2)
    assert truncated and len(entries) == 2


def set_immutable(path: Path, on: bool) -> None:
    """``chattr [+-]i``: FS_IOC_GETFLAGS/SETFLAGS with FS_IMMUTABLE_FL (linux/fs.h)."""
    import array
    import fcntl
    import struct

    long = struct.calcsize("l")
    get, put = (2 << 30) | (long << 16) | (ord("f") << 8) | 1, (1 << 30) | (long << 16) | (ord("f") << 8) | 2
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, get, flags, True)
        flags[0] = (flags[0] | 0x10) if on else (flags[0] & ~0x10)
        fcntl.ioctl(fd, put, flags, False)
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file immutable needs root")
@pytest.mark.parametrize("layout", [ws_only, rooted])
def test_a_write_the_kernel_refuses_is_a_clear_error(tree, layout) -> None:
    w = layout(tree)
    frozen = tree["ws"] / "frozen"
    assert w.write_bytes("frozen", b"one") == "/data/slot_1/frozen"  # positive control
    try:
        set_immutable(frozen, True)
    except OSError as exc:
        pytest.skip(f"this file system has no immutable flag: {exc}")
    try:
        with pytest.raises(FileToolError) as err:
            w.write_bytes("frozen", b"two")
        assert str(err.value) == "cannot write /data/slot_1/frozen: Operation not permitted"
        assert frozen.read_bytes() == b"one"
    finally:
        set_immutable(frozen, False)
    intact(tree)


@pytest.mark.parametrize("layout", [ws_only, rooted])
def test_a_chain_of_forty_links_resolves_and_one_more_is_refused(tree, layout) -> None:
    """MAX_LINKS (40, as the kernel's) symbolic links on one path are followed; 41 are not."""
    w = layout(tree)
    from hermes_modal_tool.agent.files.files import MAX_LINKS

    assert MAX_LINKS == 40
    os.symlink("mine.txt", tree["ws"] / "chain1")
    for i in range(2, MAX_LINKS + 2):
        os.symlink(f"chain{i - 1}", tree["ws"] / f"chain{i}")
    assert read(w, f"chain{MAX_LINKS}") == b"mine"
    with pytest.raises(FileToolError) as err:
        read(w, f"chain{MAX_LINKS + 1}")
    assert str(err.value) == f"too many symbolic links in 'chain{MAX_LINKS + 1}'"


class SwappingWorkspace(Workspace):
    """What a slot can do between the walk and the open: replace the file the walk
    resolved with a symbolic link to the canary outside (done here after each walk)."""

    def walk(self, path, create_parents=False, follow_last=True):
        dir_fd, name, shown = super().walk(path, create_parents, follow_last)
        if name is not None:
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            os.symlink(self.canary, name, dir_fd=dir_fd)
        return dir_fd, name, shown


@pytest.mark.parametrize("rooted_layout", [False, True])
def test_a_link_swapped_in_after_the_walk_is_never_followed(tree, rooted_layout) -> None:
    w = (SwappingWorkspace(str(tree["root"]), "/", cwd="/data/slot_1") if rooted_layout
         else SwappingWorkspace(str(tree["ws"]), "/data/slot_1"))
    w.canary = str(tree["outside"] / "canary")
    assert (tree["outside"] / "canary").read_text() == TOKEN  # positive control: a readable canary
    for path in ("mine.txt", "new.txt"):
        with pytest.raises(FileToolError) as err:
            w.write_bytes(path, b"pwned")
        assert str(err.value) == f"cannot write /data/slot_1/{path}: Too many levels of symbolic links"
        os.unlink(tree["ws"] / path)
        (tree["ws"] / path).write_text("a file again")  # swapped after open_read's walk
        with pytest.raises(FileToolError) as err:
            w.open_read(path)
        assert str(err.value) == f"cannot open /data/slot_1/{path}: Too many levels of symbolic links"
        assert os.readlink(tree["ws"] / path) == w.canary  # the swap happened
    intact(tree)


@pytest.mark.parametrize("layout", [ws_only, rooted])
def test_a_socket_is_refused_naming_it(tree, layout) -> None:
    import socket

    w = layout(tree)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tree["ws"] / "sock"))
        assert stat.S_ISSOCK(os.lstat(tree["ws"] / "sock").st_mode)  # positive control
        with pytest.raises(FileToolError) as err:
            read(w, "sock")
        assert str(err.value) == "cannot open /data/slot_1/sock: No such device or address"


def test_a_workspace_that_is_not_a_directory_is_refused(tmp_path: Path) -> None:
    """A workspace path that is a file (never one a slot can make, but the walk's
    first open says so): every tool call fails there, none sees it as a directory."""
    f = tmp_path / "file"
    f.write_text("x")
    w = Workspace(str(f), "/data/slot_1")
    for call in (lambda: w.read_bytes("."), lambda: w.write_bytes(".", b"y"), lambda: w.list_dir(".")):
        with pytest.raises(NotADirectoryError):
            call()
    assert f.read_text() == "x"
