"""The snapshot importer (agent/state/transfer.py ``_read_tar``: the header's checks, each
member's checks, the extraction beneath each layer's directory), in process on a
temporary directory (milliseconds a test: the mutation script runs these against every
mutant, confined to a private /tmp). The sandbox-level tests of import are in
test_snapshot_import_refusals.py and test_snapshot_transfer.py.

Streams are built with ``tarfile`` in the exporter's format. Each refusal sits beside its
positive control (the same stream without the hostile member imports), and a canary
beside the import's directory is checked after every stream, refused or not.
"""

from __future__ import annotations

import base64
import io
import json
import os
import stat
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from hermes_modal_tool.agent.state import transfer
from hermes_modal_tool.agent.state.snapshots import SnapshotError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="an import sets owners and trusted.* xattrs (root)")

MOUNTS = ["/", "/data"]  # the sandbox's layer roots (mount 0 and mount 1)
CANARY = b"host canary\n"


def meta(**over) -> dict:
    return {"format": transfer.FORMAT, "mounts": list(MOUNTS), "layers": 2, **over}


def reg(name: str, data: bytes = b"x\n", mode: int = 0o644, **attrs) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    for key, value in attrs.items():
        setattr(info, key, value)
    return info, data


def entry(name: str, kind: bytes, **attrs) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.mode = kind, 0o755 if kind == tarfile.DIRTYPE else 0o644
    for key, value in attrs.items():
        setattr(info, key, value)
    return info, None


def xattr(name: str, value: bytes) -> dict[str, str]:
    return {f"HMT.xattr.{name}": base64.b64encode(value).decode()}


def stream(head: dict | None, members: list) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        if head is not None:
            data = json.dumps(head).encode()
            info = tarfile.TarInfo(transfer.META)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    """``(base, outside)``: the import's directory (empty) and a host directory beside it
    holding a canary."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary").write_bytes(CANARY)
    base = tmp_path / "base"
    base.mkdir()
    return base, outside


def read(base: Path, data: bytes):
    agent = SimpleNamespace(upper_plan=SimpleNamespace(mounts=list(MOUNTS)))
    return transfer._read_tar(agent, str(base), io.BytesIO(data))


def canary_intact(outside: Path) -> None:
    assert (outside / "canary").read_bytes() == CANARY and os.listdir(outside) == ["canary"]


def good_members(outside: Path) -> list:
    """Layer 0 (top) of both mounts and layer 1 of mount 0, with every member kind."""
    return [
        entry("L0/m0", tarfile.DIRTYPE, mode=0o751, uid=5, gid=6, mtime=1_000_000),
        entry("L0/m0/etc", tarfile.DIRTYPE, mode=0o755),
        entry("L0/m0/etc/gone", tarfile.CHRTYPE, devmajor=0, devminor=0),  # a whiteout
        entry("L0/m0/ro", tarfile.DIRTYPE, mode=0o500, uid=7, gid=8, mtime=2_000_000,
              pax_headers=xattr("trusted.overlay.opaque", b"y")),
        reg("L0/m0/ro/file.txt", b"hello\n", mode=0o640, uid=9, gid=10, mtime=3_000_000,
            pax_headers=xattr("user.note", b"n")),
        entry("L0/m0/ro/hard", tarfile.LNKTYPE, linkname="L0/m0/ro/file.txt"),
        entry("L0/m0/link", tarfile.SYMTYPE, linkname=str(outside / "canary"), uid=11, gid=12),
        entry("L0/m0/etc/sub", tarfile.DIRTYPE, mode=0o700, uid=15, gid=16),
        entry("L0/m0/new/hard", tarfile.LNKTYPE, linkname="L0/m0/ro/file.txt"),  # new/ not listed
        reg("L0/m1/data.bin", b"12345"),
        reg("L1/m0/deep/er/lower.txt", b"lower\n"),  # its directories not listed: made
    ]


def test_a_well_formed_stream_is_unpacked_with_its_owners_modes_times_and_records(dirs) -> None:
    base, outside = dirs
    got_meta, sizes = read(base, stream(meta(layers=3), good_members(outside)))
    assert got_meta == meta(layers=3)
    assert sizes == [len(b"hello\n") + len(b"12345"), len(b"lower\n"), 0]
    top = base / "L0" / "upper"
    st = os.lstat(top)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime) == (0o751, 5, 6, 1_000_000)
    ro = os.lstat(top / "ro")  # set after its children were written
    assert (stat.S_IMODE(ro.st_mode), ro.st_uid, ro.st_gid, ro.st_mtime) == (0o500, 7, 8, 2_000_000)
    assert os.getxattr(top / "ro", "trusted.overlay.opaque") == b"y"
    f = os.lstat(top / "ro" / "file.txt")
    assert (top / "ro" / "file.txt").read_bytes() == b"hello\n"
    assert (stat.S_IMODE(f.st_mode), f.st_uid, f.st_gid, f.st_mtime) == (0o640, 9, 10, 3_000_000)
    assert os.getxattr(top / "ro" / "file.txt", "user.note") == b"n"
    assert os.lstat(top / "ro" / "hard").st_ino == f.st_ino == os.lstat(top / "new" / "hard").st_ino
    assert f.st_nlink == 3
    sub = os.lstat(top / "etc" / "sub")
    assert (stat.S_IMODE(sub.st_mode), sub.st_uid, sub.st_gid) == (0o700, 15, 16)
    wh = os.lstat(top / "etc" / "gone")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == os.makedev(0, 0)
    link = os.lstat(top / "link")
    assert stat.S_ISLNK(link.st_mode) and os.readlink(top / "link") == str(outside / "canary")
    assert (link.st_uid, link.st_gid) == (11, 12)
    assert (base / "L0" / "layers" / "1" / "upper" / "data.bin").read_bytes() == b"12345"
    assert (base / "L1" / "upper" / "deep" / "er" / "lower.txt").read_bytes() == b"lower\n"
    # Every layer has every mount's upper directory, if empty.
    for k in range(3):
        assert (base / f"L{k}" / "upper").is_dir() and (base / f"L{k}" / "layers" / "1" / "upper").is_dir()
    assert sorted(os.listdir(base)) == ["L0", "L1", "L2"]
    assert os.listdir(base / "L2" / "upper") == [] and sorted(os.listdir(base / "L1")) == ["layers", "upper"]
    assert os.listdir(base / "L1" / "layers") == ["1"]
    canary_intact(outside)


def test_a_fifo_the_slot_made_is_imported_as_a_fifo(dirs) -> None:
    # The exporter writes a slot's FIFOs (agent/state/transfer.py _add_tree); an import
    # refused them as devices, so such a slot's export could not be imported.
    base, outside = dirs
    read(base, stream(meta(layers=1), [entry("L0/m0/pipe", tarfile.FIFOTYPE, mode=0o600, uid=3, gid=4)]))
    st = os.lstat(base / "L0" / "upper" / "pipe")
    assert stat.S_ISFIFO(st.st_mode) and (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o600, 3, 4)
    canary_intact(outside)


def test_a_layer_of_the_last_index_and_one_of_one_layer_import(dirs) -> None:
    base, outside = dirs
    read(base, stream(meta(layers=1), [reg("L0/m1/only", b"1")]))
    assert (base / "L0" / "layers" / "1" / "upper" / "only").read_bytes() == b"1"
    canary_intact(outside)


def test_a_taken_name_is_replaced_never_written_through(dirs) -> None:
    base, outside = dirs
    members = [entry("L0/m0/x", tarfile.SYMTYPE, linkname=str(outside / "canary")),
               reg("L0/m0/x", b"replaced\n")]
    read(base, stream(meta(), members))
    x = base / "L0" / "upper" / "x"
    assert not x.is_symlink() and x.read_bytes() == b"replaced\n"
    canary_intact(outside)


HOSTILE = {
    "absolute": reg("/L0/m0/evil"),
    "dotdot": reg("L0/m0/../../evil"),
    "dotdot-layer": reg("../L0/m0/evil"),
    "dot": reg("L0/m0/./evil"),
    "empty part": reg("L0/m0//evil"),
    "one part": reg("L0"),
    "layer not L": reg("X0/m0/evil"),
    "mount not m": reg("L0/x0/evil"),
    "layer not a number": reg("Lx/m0/evil"),
    "mount not a number": reg("L0/mx/evil"),
    "layer past the count": reg("L2/m0/evil"),
    "layer far past the count": reg("L3/m0/evil"),
    "negative layer": reg("L-1/m0/evil"),
    "mount past the roots": reg("L0/m2/evil"),
    "negative mount": reg("L0/m-1/evil"),
    "below its symlink": reg("L0/m0/in/evil"),
    "below its symlink, deeper": reg("L0/m0/in/a/evil"),
    "char device": entry("L0/m0/evil", tarfile.CHRTYPE, devmajor=1, devminor=3),
    "char device 0/1": entry("L0/m0/evil", tarfile.CHRTYPE, devmajor=0, devminor=1),
    "char device 1/0": entry("L0/m0/evil", tarfile.CHRTYPE, devmajor=1, devminor=0),
    "block device 0/0": entry("L0/m0/evil", tarfile.BLKTYPE, devmajor=0, devminor=0),
    "hard link to a later member": entry("L0/m0/evil", tarfile.LNKTYPE, linkname="L0/m0/later"),
    "hard link out": entry("L0/m0/evil", tarfile.LNKTYPE, linkname="/etc/passwd"),
    "hard link to a layer root": entry("L0/m0/evil", tarfile.LNKTYPE, linkname="L0/m0"),
    "layer root not a directory": reg("L0/m1"),
    "unknown type": entry("L0/m0/evil", b"Z"),
}
MESSAGES = {
    "layer past the count": "outside the snapshot's layers", "layer far past the count": "outside the snapshot's layers",
    "unknown type": "of an unknown type", "negative layer": "outside the snapshot's layers",
    "mount past the roots": "outside the snapshot's layers", "negative mount": "outside the snapshot's layers",
    "below its symlink": "below a symbolic link", "below its symlink, deeper": "below a symbolic link",
    "char device": "is not a whiteout", "char device 0/1": "is not a whiteout",
    "char device 1/0": "is not a whiteout", "block device 0/0": "is not a whiteout",
    "hard link to a later member": "not an earlier member", "hard link out": "not an earlier member",
    "hard link to a layer root": "not a file", "layer root not a directory": "is not a directory",
}


def ordinary(outside: Path) -> list:
    """The members around a hostile one: a layer root, a file, and a symlink ``in`` to
    the outside directory (members below it are refused)."""
    return [entry("L0/m0", tarfile.DIRTYPE), reg("L0/m0/ok.txt", b"ok\n"),
            entry("L0/m0/in", tarfile.SYMTYPE, linkname=str(outside))]


@pytest.mark.parametrize("case", list(HOSTILE))
def test_each_hostile_member_is_refused_naming_it(dirs, case) -> None:
    base, outside = dirs
    (base / "control").mkdir()
    (base / "hostile").mkdir()
    # Positive control: without the hostile member, the same stream imports.
    read(base / "control", stream(meta(), ordinary(outside)))
    assert (base / "control" / "L0" / "upper" / "ok.txt").read_bytes() == b"ok\n"
    info, data = HOSTILE[case]
    members = [*ordinary(outside), (info, data), reg("L0/m0/later", b"later\n")]
    with pytest.raises(SnapshotError) as err:
        read(base / "hostile", stream(meta(), members))
    assert MESSAGES.get(case, "bad member name") in str(err.value), err.value
    assert repr(info.name) in str(err.value), err.value
    assert (base / "hostile" / "L0" / "upper" / "ok.txt").read_bytes() == b"ok\n"  # read up to it
    assert not (base / "hostile" / "L0" / "upper" / "later").exists()  # and stopped there
    assert "evil" not in {p.name for p in base.rglob("*")}
    canary_intact(outside)
    assert not (outside.parent / "evil").exists()


def test_nothing_is_written_through_a_hard_link_to_a_symlink(dirs) -> None:
    """A hard link to a symlink member is a symlink of another name (not in the importer's
    list of symlinks): a member below it is refused all the same (the layer's tree
    follows no symlink), not written where the link points."""
    base, outside = dirs
    members = [entry("L0/m0/sub", tarfile.DIRTYPE), entry("L0/m0/in", tarfile.SYMTYPE, linkname="sub"),
               entry("L0/m0/h", tarfile.LNKTYPE, linkname="L0/m0/in")]
    (base / "control").mkdir()
    read(base / "control", stream(meta(), members))  # positive control: h is that symlink
    assert os.readlink(base / "control" / "L0" / "upper" / "h") == "sub"
    (base / "hostile").mkdir()
    with pytest.raises(OSError):
        read(base / "hostile", stream(meta(), [*members, reg("L0/m0/h/evil")]))
    assert "evil" not in {p.name for p in base.rglob("*")}
    canary_intact(outside)


def raw_header(name: str, size: int) -> bytes:
    """A tar holding only the header of a member ``name`` of ``size`` bytes (no data)."""
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(tarfile.PAX_FORMAT)


@pytest.mark.parametrize("head, data, message", [
    (None, stream(None, [reg("L0/m0/f")]), "not a snapshot stream: it must start with hmt-snapshot.json"),
    (None, stream(None, [entry(transfer.META, tarfile.DIRTYPE)]), "not a snapshot stream"),
    (None, raw_header(transfer.META, 64 * 1024 * 1024 + 1), "not a snapshot stream"),
    (meta(format=2), None, "snapshot format 2; this agent reads 1"),
    (meta(format=None), None, "snapshot format None; this agent reads 1"),
    (meta(mounts=["/"]), None, "the snapshot's layer roots ['/'] differ from this sandbox's ['/', '/data']"),
    (meta(mounts=None), None, "layer roots None differ"),
    (meta(layers=0), None, "bad layer count 0"),
    (meta(layers=129), None, "bad layer count 129"),
    (meta(layers="2"), None, "bad layer count '2'"),
    (meta(layers=None), None, "bad layer count None"),
    (None, b"\0" * 1024, "empty snapshot stream"),
])
def test_a_bad_header_is_refused_naming_what_is_wrong(dirs, head, data, message) -> None:
    base, outside = dirs
    with pytest.raises(SnapshotError) as err:
        read(base, data if data is not None else stream(head, [reg("L0/m0/f")]))
    assert message in str(err.value), err.value
    assert not any(base.rglob("f"))
    canary_intact(outside)


@pytest.mark.parametrize("layers", [1, 128])
def test_the_header_limits_themselves_are_accepted(dirs, layers) -> None:
    base, outside = dirs
    got, sizes = read(base, stream(meta(layers=layers), [reg("L0/m0/f", b"abc")]))
    assert got["layers"] == layers and sizes == [3] + [0] * (layers - 1)
    assert len(os.listdir(base)) == layers
    canary_intact(outside)


def test_a_header_of_the_size_limit_is_read(dirs) -> None:
    """The header may be up to 64 MiB: one of exactly that size (padded with spaces,
    valid JSON) is accepted."""
    base, outside = dirs
    head = json.dumps(meta(layers=1)).encode()
    head += b" " * (64 * 1024 * 1024 - len(head))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(transfer.META)
        info.size = len(head)
        tar.addfile(info, io.BytesIO(head))
    got, sizes = read(base, buf.getvalue())
    assert got == meta(layers=1) and sizes == [0]
    canary_intact(outside)
