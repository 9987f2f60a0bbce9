"""The image unpacker (images/unpack.py) on real layer tars, in process (milliseconds a
test: the mutation script runs these against every mutant; hostile archives against the
host are in security/test_attack_unpack.py and test_attack_image_privs.py, the unpacker
against umoci in test_images.py).

The verdicts are the unpacked tree itself (``os.lstat``/``readlink``/contents, read after
the layers were applied) and the errors' messages; every deletion (whiteout, opaque
directory, replaced entry) sits beside the positive control that the lower layer's entry
was there after the lower layer alone.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import os
import stat
import tarfile
from pathlib import Path

import pytest

from hermes_modal_tool.errors import ImageError
from hermes_modal_tool.images import unpack as up
from hermes_modal_tool.images.limits import ImageLimits
from hermes_modal_tool.images.sources import ImageSource, Layer, Source

MTIME = 1_600_000_000


def entry(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", mode: int = 0o644,
          link: str = "", mtime: int = MTIME, pax: dict | None = None) -> tuple:
    return name, kind, data, mode, link, mtime, pax


def tar_bytes(*entries: tuple) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, data, mode, link, mtime, pax in entries:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime, info.linkname = kind, mode, mtime, link
            if pax:
                info.pax_headers = pax
            if kind == tarfile.REGTYPE:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
                    info.devmajor, info.devminor = 1, 3
                tar.addfile(info)
    return buf.getvalue()


def apply(root: Path, *entries: tuple, done: up.Unpacked | None = None) -> int:
    with tarfile.open(fileobj=io.BytesIO(tar_bytes(*entries)), mode="r|") as tar:
        return up.apply_layer(str(root), tar, None, done)


def names(root: Path) -> list[str]:
    out = []
    for where, dirs, files in os.walk(root):
        for n in dirs + files:
            out.append(os.path.relpath(os.path.join(where, n), root))
    return sorted(out)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "rootfs"
    r.mkdir()
    return r


LOWER = (entry("etc", tarfile.DIRTYPE, mode=0o755), entry("etc/gone.txt", data=b"old"),
         entry("etc/keep.txt", data=b"keep"), entry("opt", tarfile.DIRTYPE, mode=0o755),
         entry("opt/opq", tarfile.DIRTYPE, mode=0o755), entry("opt/opq/old", data=b"o"),
         entry("opt/opq/deep", tarfile.DIRTYPE, mode=0o755), entry("opt/opq/deep/old2", data=b"o"),
         entry("opt/file_then_dir", data=b"f"), entry("opt/dir_then_file", tarfile.DIRTYPE),
         entry("opt/dir_then_file/x", data=b"x"))


def test_whiteouts_opaque_directories_and_replacements(root) -> None:
    assert apply(root, *LOWER) == len(LOWER)
    # Positive control: the lower layer's entries are there.
    assert {"etc/gone.txt", "opt/opq/old", "opt/opq/deep/old2", "opt/dir_then_file/x"} <= set(names(root))
    count = apply(root, entry("etc/.wh.gone.txt"), entry("nowhere/.wh.x"),
                  entry("opt/opq/new", data=b"n"), entry("opt/opq/.wh..wh..opq"),
                  entry("opt/opq/deep", tarfile.DIRTYPE), entry("opt/opq/deep/new2", data=b"n2"),
                  entry("opt/file_then_dir", tarfile.DIRTYPE), entry("opt/dir_then_file", data=b"now a file"))
    assert count == 8  # whiteouts count as entries, those with nothing below too
    got = set(names(root))
    assert "etc/gone.txt" not in got and (root / "etc/keep.txt").read_bytes() == b"keep"
    assert {"opt/opq/new", "opt/opq/deep/new2"} <= got  # this layer's stay under its opaque marker
    assert "opt/opq/old" not in got and "opt/opq/deep/old2" not in got  # the lower's go, however deep
    assert not any(".wh." in n for n in got) and "nowhere" not in got
    assert stat.S_ISDIR(os.lstat(root / "opt/file_then_dir").st_mode)
    assert (root / "opt/dir_then_file").read_bytes() == b"now a file"


def test_an_opaque_marker_keeps_a_directory_this_layer_made_anew(root) -> None:
    apply(root, entry("d", tarfile.DIRTYPE), entry("d/sub", tarfile.DIRTYPE), entry("d/sub/low", data=b"l"),
          entry("d/low2", data=b"l"))
    assert (root / "d/sub/low").exists() and (root / "d/low2").exists()
    apply(root, entry("d/sub", data=b"a file now"), entry("d/.wh..wh..opq"), entry("d/new", data=b"n"))
    assert names(root) == ["d", "d/new", "d/sub"] and (root / "d/sub").read_bytes() == b"a file now"


def test_an_opaque_marker_after_the_layers_own_entries_clears_merged_directories_deeply(root) -> None:
    apply(root, entry("o", tarfile.DIRTYPE), entry("o/deep", tarfile.DIRTYPE), entry("o/deep/old", data=b"o"),
          entry("o/old", data=b"o"))
    assert (root / "o/deep/old").exists() and (root / "o/old").exists()
    apply(root, entry("o/deep", tarfile.DIRTYPE), entry("o/deep/new", data=b"n"), entry("o/.wh..wh..opq"))
    assert names(root) == ["o", "o/deep", "o/deep/new"]


@pytest.mark.parametrize("bad", ["etc/.wh.", "etc/.wh..", "etc/.wh..."])
def test_a_whiteout_that_names_nothing_is_refused(root, bad) -> None:
    apply(root, entry("etc", tarfile.DIRTYPE), entry("etc/f", data=b"f"))
    with pytest.raises(ValueError, match="names no entry"):
        apply(root, entry(bad))
    assert (root / "etc/f").read_bytes() == b"f"


def test_dotdot_is_refused_and_dot_components_dropped(root) -> None:
    assert up._parts("./a//b/.") == ["a", "b"] and up._parts("/") == [] and up._parts(".") == []
    with pytest.raises(ValueError, match=r"entry 'a/../../x' climbs out of the image with '\.\.'"):
        up._parts("a/../../x")
    assert apply(root, entry("./", tarfile.DIRTYPE), entry("./a.txt", data=b"a")) == 1  # the root: no entry


def test_kinds_modes_times_links_and_left_out_devices(root) -> None:
    done = up.Unpacked()
    apply(root, entry("bin", tarfile.DIRTYPE, mode=0o2755, mtime=MTIME - 50),
          entry("bin/su", data=b"#!", mode=0o4755), entry("bin/sg", data=b"#!", mode=0o2711),
          entry("bin/plain", data=b"p", mode=0o640, mtime=MTIME - 7),
          entry("bin/hard", tarfile.LNKTYPE, link="bin/plain"),
          entry("bin/sym", tarfile.SYMTYPE, link="../etc/nowhere", mode=0o777),
          entry("bin/fifo", tarfile.FIFOTYPE, mode=0o600),
          *[entry(f"dev/n{i}", tarfile.CHRTYPE) for i in range(11)], entry("dev/b", tarfile.BLKTYPE),
          done=done)
    assert done.setid == 2 and done.devices == 12 and len(done.device_names) == 10
    assert done.device_names[0] == "/dev/n0" and done.capabilities == 0
    assert done.notes() == {"devices_skipped": 12, "device_names": done.device_names,
                            "setid_cleared": 2, "capabilities_dropped": 0}
    assert stat.S_IMODE(os.lstat(root / "bin/su").st_mode) == 0o755
    assert stat.S_IMODE(os.lstat(root / "bin/sg").st_mode) == 0o711
    plain = os.lstat(root / "bin/plain")
    assert stat.S_IMODE(plain.st_mode) == 0o640 and plain.st_mtime == MTIME - 7
    assert os.lstat(root / "bin/hard").st_ino == plain.st_ino and plain.st_nlink == 2
    assert os.readlink(root / "bin/sym") == "../etc/nowhere"
    assert stat.S_ISFIFO(os.lstat(root / "bin/fifo").st_mode)
    assert stat.S_IMODE(os.lstat(root / "bin/fifo").st_mode) == 0o600
    assert not any(n.startswith("dev/n") for n in names(root)) and "dev/b" not in names(root)
    # A directory keeps its set-group-ID bit and its own time, set after its children.
    d = os.lstat(root / "bin")
    assert stat.S_IMODE(d.st_mode) == 0o2755 and d.st_mtime == MTIME - 50
    apply(root, entry("bin/sub", tarfile.DIRTYPE, mode=0o710, mtime=MTIME - 90),
          entry("bin/sub/x", data=b"x"))
    sub = os.lstat(root / "bin/sub")  # a nested directory too
    assert stat.S_IMODE(sub.st_mode) == 0o710 and sub.st_mtime == MTIME - 90


@pytest.mark.skipif(os.geteuid() != 0, reason="ownership is kept only when running as root")
def test_ownership_is_kept_as_root(root) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind in (("d", tarfile.DIRTYPE), ("d/f", tarfile.REGTYPE), ("d/l", tarfile.SYMTYPE)):
            info = tarfile.TarInfo(name)
            info.type, info.uid, info.gid, info.linkname = kind, 1234, 5678, "f" if kind == tarfile.SYMTYPE else ""
            tar.addfile(info, io.BytesIO(b"") if kind == tarfile.REGTYPE else None)
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue()), mode="r|") as tar:
        up.apply_layer(str(root), tar)
    for name in ("d", "d/f", "d/l"):
        st = os.lstat(root / name)
        assert (st.st_uid, st.st_gid) == (1234, 5678), name


def test_a_device_replaces_the_lower_entry_all_the_same(root) -> None:
    apply(root, entry("dev", tarfile.DIRTYPE), entry("dev/null", data=b"lower"))
    assert (root / "dev/null").read_bytes() == b"lower"
    apply(root, entry("dev/null", tarfile.CHRTYPE))
    assert not (root / "dev/null").exists()


def test_a_hard_link_to_the_root_is_refused(root) -> None:
    with pytest.raises(ValueError, match="hard link 'x' to the image's root"):
        apply(root, entry("x", tarfile.LNKTYPE, link="./"))


def test_a_directory_replaced_later_in_the_layer_keeps_the_later_entry(root) -> None:
    apply(root, entry("d", tarfile.DIRTYPE, mode=0o700), entry("d", data=b"file", mode=0o604))
    st = os.lstat(root / "d")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o604


def test_xattrs_kept_and_file_capabilities_dropped(root) -> None:
    done = up.Unpacked()
    pax = {"SCHILY.xattr.user.note": "kept", "SCHILY.xattr.security.capability": "\x01\x00",
           "comment": "not an xattr"}
    member = tarfile.TarInfo("f")
    member.pax_headers = pax
    assert up._xattrs(member, done) == [("user.note", b"kept")] and done.capabilities == 1
    apply(root, entry("f", data=b"x", pax=pax), done=done)
    assert done.capabilities == 2
    try:
        assert os.getxattr(root / "f", "user.note") == b"kept"
    except OSError:  # a file system without user xattrs: the drop above is the verdict
        pass
    assert "security.capability" not in os.listxattr(root / "f")


def test_compressed_layers_are_read_by_their_magic(root) -> None:
    import zstandard

    plain = tar_bytes(entry("a.txt", data=b"A" * 5000))
    low = tar_bytes(entry("!a", data=b"x"))  # a plain tar whose first bytes sort below zstd's magic
    for blob in (plain, low, gzip.compress(plain), zstandard.ZstdCompressor().compress(plain)):
        stream = up._decompressed(io.BytesIO(blob), "")
        assert stream.read() in (plain, low)
    small = up._Prefixed(b"abcd", io.BytesIO(b"efgh"))
    buf = bytearray(3)
    got = b""
    while n := small.readinto(buf):
        got += bytes(buf[:n])
    assert got == b"abcdefgh" and small.readable()


def image(layers: list[bytes], *, digests: list[str] | None = None, diff_ids: list[str | None] | None = None,
          verify: bool = True) -> ImageSource:
    src = ImageSource(Source("test/img:1", "oci", "/nowhere", "1"), "sha256:x", {}, [])
    for i, blob in enumerate(layers):
        digest = (digests or [None] * len(layers))[i] or "sha256:" + hashlib.sha256(blob).hexdigest()
        layer = Layer(digest, "application/vnd.oci.image.layer.v1.tar", len(blob), verify=verify)
        layer.opener = lambda blob=blob: io.BytesIO(blob)
        layer.diff_id = (diff_ids or [None] * len(layers))[i]
        src.layers.append(layer)
    return src


LIMITS = ImageLimits(max_bytes=1 << 20, max_layers=8, max_files=100)


def test_unpack_layers_applies_them_in_order_and_checks_their_digests(root, caplog) -> None:
    low = tar_bytes(entry("f", data=b"low"), entry("g", data=b"g"), entry("dev", tarfile.DIRTYPE),
                    entry("dev/sda", tarfile.BLKTYPE))
    high = gzip.compress(tar_bytes(entry("f", data=b"high"), entry(".wh.g")))
    seen = []
    with caplog.at_level(logging.WARNING, logger="hermes_modal_tool"):
        done = up.unpack_layers(image([low, high], diff_ids=[None, "sha256:" + hashlib.sha256(
            tar_bytes(entry("f", data=b"high"), entry(".wh.g"))).hexdigest()]), str(root),
            progress=lambda i, n, layer: seen.append((i, n, layer.size)), limits=LIMITS)
    assert seen == [(1, 2, len(low)), (2, 2, len(high))]
    assert (root / "f").read_bytes() == b"high" and not (root / "g").exists()
    assert done.devices == 1 and "1 device node(s) skipped (/dev/sda)" in caplog.text


def test_unpack_layers_names_a_corrupt_or_broken_layer(tmp_path) -> None:
    good = tar_bytes(entry("f", data=b"x"))
    cases = [
        (image([good], digests=["sha256:" + "0" * 64]), "layer 1/1 (sha256:000", "is corrupt: its content hashes to sha256:"),
        (image([good], diff_ids=["sha256:" + "1" * 64]), "layer 1/1", "its tar hashes to sha256:"),
        (image([b"not a tar at all" * 40]), "layer 1/1", "could not be unpacked"),
        (image([tar_bytes(entry("../x", data=b"x"))]), "layer 1/1", "climbs out of the image"),
        (image([good, good], digests=[None, "sha256:" + "2" * 64]), "layer 2/2", "is corrupt"),
    ]
    for i, (img, where, why) in enumerate(cases):
        (tmp_path / f"r{i}").mkdir()
        with pytest.raises(ImageError) as exc:
            up.unpack_layers(img, str(tmp_path / f"r{i}"), limits=LIMITS)
        msg = str(exc.value)
        assert "image 'test/img:1'" in msg and where in msg and why in msg, msg
    # Positive control: unverified (a docker archive's file names), the same blob unpacks.
    (tmp_path / "ok").mkdir()
    up.unpack_layers(image([good], digests=["sha256:" + "0" * 64], verify=False), str(tmp_path / "ok"),
                     limits=LIMITS)
    assert (tmp_path / "ok/f").read_bytes() == b"x"


def test_unpack_layers_is_bounded_and_says_which_limit(tmp_path) -> None:
    blob = tar_bytes(*[entry(f"f{i}", data=b"x") for i in range(5)])
    for d in "abcd":
        (tmp_path / d).mkdir()
    with pytest.raises(ImageError, match="layer 1/1"):
        up.unpack_layers(image([blob]), str(tmp_path / "a"), limits=ImageLimits(1 << 20, 8, 4))
    with pytest.raises(ImageError, match="3 layers"):
        up.unpack_layers(image([blob] * 3), str(tmp_path / "b"), limits=ImageLimits(1 << 20, 2, 100))
    with pytest.raises(ImageError, match="layer 1/1"):  # 5 bytes of files, 4 allowed
        up.unpack_layers(image([blob]), str(tmp_path / "d"), limits=ImageLimits(4, 8, 100))
    assert len(os.listdir(tmp_path / "d")) == 4  # charged before each file is written
    up.unpack_layers(image([blob]), str(tmp_path / "c"), limits=ImageLimits(5, 1, 5))
    assert len(os.listdir(tmp_path / "c")) == 5


def test_resolve_in_root_follows_links_inside_the_root(root) -> None:
    (root / "real/sub").mkdir(parents=True)
    (root / "real/sub/file").write_text("x")
    os.symlink("/real", root / "abs")
    os.symlink("real/sub", root / "rel")
    os.symlink("../../real", root / "real/sub/up")
    os.symlink("file", root / "real/sub/last")
    os.symlink("loop2", root / "loop1")
    os.symlink("loop1", root / "loop2")
    r = str(root)
    assert up.resolve_in_root(r, ["abs", "sub", "file"]) == f"{r}/real/sub/file"
    assert up.resolve_in_root(r, ["rel", "file"]) == f"{r}/real/sub/file"
    assert up.resolve_in_root(r, ["real", "sub", "up", "sub"]) == f"{r}/real/sub"  # '..' stops at the root
    assert up.resolve_in_root(r, ["..", "..", "real", ".", "sub"]) == f"{r}/real/sub"
    assert up.resolve_in_root(r, ["rel", "last"]) == f"{r}/real/sub/last"  # the last part as it is
    assert up.resolve_in_root(r, ["rel", "last"], follow_last=True) == f"{r}/real/sub/file"
    with pytest.raises(ValueError, match="too many symlinks under /loop1/x"):
        up.resolve_in_root(r, ["loop1", "x"])
