"""The host's end of a directory download: a slot's tar stream is unpacked beneath the
local directory's descriptor (``agent/files/tarstream.py``, the code the host runs in
``filetransfer``), and a hostile one is refused with nothing written outside it, checked
on this host's files (a canary's content and mode)."""

from __future__ import annotations

import io
import os
import stat

import pytest
from test_data_shared import canary_state, hostile_tars

from hermes_modal_tool.agent.files import tarstream


def unpack_into(dst, data: bytes) -> tuple[int, int]:
    fd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return tarstream.unpack(io.BytesIO(data), fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("name", list(hostile_tars("/x")))
def test_a_hostile_stream_is_refused_and_writes_nothing_outside(tmp_path, name):
    outside = tmp_path / "outside"
    outside.mkdir()
    canary = outside / "canary.txt"
    canary.write_bytes(b"canary")
    canary.chmod(0o600)
    before = canary_state(canary)
    dst = tmp_path / "dst"
    dst.mkdir()
    with pytest.raises(tarstream.TarRefused):
        unpack_into(dst, hostile_tars(str(outside))[name])
    assert canary_state(canary) == before and sorted(os.listdir(outside)) == ["canary.txt"]
    assert (dst / "ok.txt").read_bytes() == b"ok"  # positive control: read up to the hostile member
    made = {str(p.relative_to(dst)) for p in dst.rglob("*")}
    assert made <= {"ok.txt", "d", "in"}, made
    assert not any(stat.S_ISCHR(os.lstat(p).st_mode) for p in dst.rglob("*"))


def test_a_link_the_destination_already_has_is_never_written_through(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "pre").symlink_to(outside)  # a local directory with a link in it
    buf = io.BytesIO()
    import tarfile

    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("pre/x.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"pwned"))
    with pytest.raises(tarstream.TarRefused, match="symbolic link"):
        unpack_into(dst, buf.getvalue())
    assert os.listdir(outside) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="gives files to another uid (root)")
def test_pack_and_the_manifest_walk_one_tree_leaving_out_what_the_owner_does_not_own(tmp_path):
    """``pack(owner=)`` and ``treesums.files_below`` walk the same tree in the same order
    (``tarstream.entries_below``): another uid's file and directory are left out (counted
    by ``pack``, the directory not entered), a link is kept whoever owns it, and the
    owner's files are packed (the control) and listed alike."""
    import tarfile

    from hermes_modal_tool.agent.files import treesums

    src = tmp_path / "src"
    (src / "a" / "deep").mkdir(parents=True)
    (src / "a" / "deep" / "mine.txt").write_text("mine\n")
    (src / "b.txt").write_text("b\n")
    (src / "theirs.txt").write_text("theirs\n")
    (src / "theirdir").mkdir()
    (src / "theirdir" / "inside.txt").write_text("inside\n")
    os.symlink("b.txt", src / "link")
    for p in (src / "theirs.txt", src / "theirdir"):
        os.chown(p, 4321, 4321)
    os.lchown(src / "link", 4321, 4321)
    fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out = io.BytesIO()
        files, nbytes, skipped = tarstream.pack(fd, out, owner=0)
        listed = [rel for rel, *_ in treesums.files_below(fd, owner=0)]
    finally:
        os.close(fd)
    names = tarfile.open(fileobj=io.BytesIO(out.getvalue())).getnames()
    assert names == ["a", "a/deep", "a/deep/mine.txt", "b.txt", "link"], names
    assert (files, nbytes, skipped) == (2, 7, 2)
    assert listed == ["a/deep/mine.txt", "b.txt"]
