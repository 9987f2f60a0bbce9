"""Hard links in directory transfers: a file with two names in the tree arrives as one
file with two names (same inode, two links) on the other side, both ways; a stream whose
hard link leads out of the tree (``..``, an absolute name) or to a name the stream did not
make is refused, in the slot (upload) and on the host (download), and no link is made to
anything outside: the verdict is the would-be target's own link count."""

from __future__ import annotations

import io
import os
import tarfile

import pytest
from support import bash

from hermes_modal_tool import TransferError, filetransfer
from hermes_modal_tool.agent.files import tarstream


def tar_with_link(link: str) -> bytes:
    """``ok.txt`` (the positive control: the stream was read up to the link), then hard
    link ``h`` -> ``link``, then ``after.txt`` (must not be made: the stream stops)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("ok.txt", b"ok"),):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("h")
        info.type, info.linkname = tarfile.LNKTYPE, link
        tar.addfile(info)
        info = tarfile.TarInfo("after.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"after"))
    return buf.getvalue()


async def test_hard_links_arrive_as_links_both_ways(make_backend, tmp_path):
    backend = await make_backend()
    slot = await backend.acquire("links")
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "b").mkdir()
    (src / "a" / "x").write_bytes(b"shared bytes")
    os.link(src / "a" / "x", src / "b" / "y")
    (src / "solo").write_bytes(b"one name")
    up = await backend.upload(slot, str(src), "t")
    assert (up.files, up.bytes) == (2, len(b"shared bytes") + len(b"one name")), up  # packed once
    r = await bash(backend, slot, "stat -c '%h %i %u' t/a/x t/b/y t/solo; cat t/b/y; echo; id -u")
    lines = r.output.splitlines()
    (n1, ino1, uid1), (n2, ino2, uid2), (n3, _, _) = (line.split() for line in lines[:3])
    assert (n1, n2, n3) == ("2", "2", "1") and ino1 == ino2, r.output  # the slot's verdict
    assert lines[3] == "shared bytes" and uid1 == uid2 == lines[4], r.output  # the slot's own file
    # The slot's own pair (made by its shell) comes back as a pair on the host.
    assert (await bash(backend, slot, "mkdir -p u/d && echo mine > u/f && ln u/f u/d/g")).success
    back = tmp_path / "back"
    down = await backend.download(slot, "u", str(back))
    assert down.files == 1, down
    f, g = os.stat(back / "f"), os.stat(back / "d" / "g")
    assert (f.st_nlink, g.st_nlink) == (2, 2) and f.st_ino == g.st_ino
    assert (back / "d" / "g").read_bytes() == b"mine\n"


@pytest.mark.parametrize("link", ["../canary.txt", "/ABS/canary.txt", "pre.txt"])
async def test_a_hard_link_out_of_the_stream_is_refused_in_the_slot(make_backend, link):
    backend = await make_backend()
    slot = await backend.acquire("hostile-links")
    # The would-be targets, made by the slot: one beside the tree, one in it already.
    r = await bash(backend, slot, "echo canary > canary.txt && mkdir t && echo pre > t/pre.txt && pwd")
    link = link.replace("/ABS", r.output.strip())

    async def chunks():
        yield tar_with_link(link)

    with pytest.raises(TransferError, match=r"hard link 'h' to .*(absolute|climbs out|not an earlier file)"):
        await filetransfer.upload_tar_stream(backend, slot, chunks(), "t", link)
    r = await bash(backend, slot, "cat t/ok.txt; echo; stat -c %h canary.txt t/pre.txt; cat canary.txt t/pre.txt;"
                                  " ls -A t")
    assert r.output.split() == ["ok", "1", "1", "canary", "pre", "ok.txt", "pre.txt"], r.output


@pytest.mark.parametrize("link", ["../canary.txt", "/ABS/canary.txt", "pre.txt"])
def test_a_hard_link_out_of_the_stream_is_refused_on_the_host(tmp_path, link):
    """The host's end of a download (``tarstream.unpack`` beneath the local directory)."""
    canary = tmp_path / "canary.txt"
    canary.write_bytes(b"canary")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "pre.txt").write_bytes(b"pre")
    fd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(tarstream.TarRefused, match=r"hard link 'h' to .*(absolute|climbs out|not an earlier)"):
            tarstream.unpack(io.BytesIO(tar_with_link(link.replace("/ABS", str(tmp_path)))), fd)
    finally:
        os.close(fd)
    assert (dst / "ok.txt").read_bytes() == b"ok"  # read up to the link
    assert sorted(os.listdir(dst)) == ["ok.txt", "pre.txt"]
    assert os.stat(canary).st_nlink == 1 and os.stat(dst / "pre.txt").st_nlink == 1
    # Positive control: a link to a file of the stream is made.
    fd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    try:
        tarstream.unpack(io.BytesIO(tar_with_link("ok.txt")), fd)
    finally:
        os.close(fd)
    assert os.stat(dst / "h").st_ino == os.stat(dst / "ok.txt").st_ino and os.stat(dst / "h").st_nlink == 2
