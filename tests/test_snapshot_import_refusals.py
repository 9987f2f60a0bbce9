"""A snapshot stream is untrusted: each refusal the importer documents (agent/state/transfer.py:
relative names below their layer, no ``..``, nothing below a symbolic link it made, hard
links to earlier members only, devices only as whiteouts; and the header's checks), each
beside a positive control (the same stream without the hostile member imports), and the
overlay records (``trusted.overlay.*`` extended attributes, whiteouts) an import applies.

Streams are built here with ``tarfile`` in the exporter's format and sent through the
public API (``ToolBackend.import_snapshot``); verdicts are taken on the host and in a
fork of what was imported.
"""

from __future__ import annotations

import base64
import io
import json
import os
import secrets
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
from support import bash

from hermes_modal_tool import SnapshotError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="snapshots need a layered root (root)")

META = "hmt-snapshot.json"


def reg(name: str, data: bytes = b"x\n", **pax: str) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.pax_headers = len(data), 0o644, dict(pax)
    return info, data


def entry(name: str, kind: bytes, **attrs) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type, info.mode = kind, 0o755 if kind == tarfile.DIRTYPE else 0o644
    for key, value in attrs.items():
        setattr(info, key, value)
    return info, None


def xattr(name: str, value: bytes) -> dict[str, str]:
    """A pax record carrying an extended attribute, as the exporter writes it."""
    return {f"HMT.xattr.{name}": base64.b64encode(value).decode()}


def stream(meta: dict, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        head = json.dumps(meta).encode()
        info = tarfile.TarInfo(META)
        info.size = len(head)
        tar.addfile(info, io.BytesIO(head))
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


@pytest.fixture
async def importer(make_backend):
    """``(backend, meta)``: a backend, and the header of a real export of its own (so that
    crafted streams pass the header's checks and reach the member checks)."""
    backend = await make_backend(slots_per_sandbox=2, max_sandboxes=1)
    parent = await backend.acquire("parent")
    r = await bash(backend, parent, "mkdir -p /workspace && echo base > /workspace/base.txt")
    assert r.success, r.output
    snap = await backend.snapshot(parent)
    data = b"".join([c async for c in backend.export_snapshot(snap)])
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        first = tar.next()
        assert first is not None and first.name == META
        meta = json.loads(tar.extractfile(first).read())
    assert meta["layers"] >= 1 and meta["mounts"], meta
    await backend.release(parent)
    return backend, meta


@pytest.fixture
def hidden_home():
    """A host directory every slot sees empty (a new home under /home), with a canary."""
    home = Path("/home") / ("hmt-import-" + secrets.token_hex(4))
    home.mkdir(mode=0o755)
    token = "import-canary-" + secrets.token_hex(8)
    (home / "canary").write_text(token + "\n")
    yield home, token
    shutil.rmtree(home, ignore_errors=True)


def base_members(m0: str) -> list:
    """A well-formed layer: a file in /workspace, a whiteout of a host file, an opaque
    directory over a host one, a symbolic link, and a hard link to an earlier member."""
    return [
        entry(f"{m0}", tarfile.DIRTYPE),
        entry(f"{m0}/workspace", tarfile.DIRTYPE),
        reg(f"{m0}/workspace/imported.txt", b"imported\n"),
        entry(f"{m0}/workspace/link", tarfile.SYMTYPE, linkname="imported.txt"),
        entry(f"{m0}/workspace/hard", tarfile.LNKTYPE, linkname=f"{m0}/workspace/imported.txt"),
        entry(f"{m0}/etc", tarfile.DIRTYPE),
        entry(f"{m0}/etc/debian_version", tarfile.CHRTYPE, devmajor=0, devminor=0),  # whiteout
        entry(f"{m0}/usr", tarfile.DIRTYPE), entry(f"{m0}/usr/share", tarfile.DIRTYPE),
        (entry(f"{m0}/usr/share/doc", tarfile.DIRTYPE)[0], None),
    ]


def opaque(members: list, name: str) -> list:
    for info, _ in members:
        if info.name == name:
            info.pax_headers = xattr("trusted.overlay.opaque", b"y")
    return members


def host_has_lower_files() -> bool:
    """What the whiteout and the opaque directory hide is on the host (the lower layer)."""
    return Path("/etc/debian_version").exists() and len(os.listdir("/usr/share/doc")) > 1


def reached_host(mark: str) -> list[str]:
    """Files named ``mark`` a refused import left on the host (removed: a planted bug that
    drops a check writes there); /etc/passwd must be intact."""
    reached = [p for p in (f"/etc/{mark}", f"/{mark}", f"/workspace/{mark}") if os.path.lexists(p)]
    for p in reached:
        os.unlink(p)
    assert Path("/etc/passwd").read_text().startswith("root:")
    return reached


async def fork_of(backend, data: bytes, trajectory: str):
    snap = await backend.import_snapshot(data)
    return await backend.acquire(trajectory, snapshot=snap)


async def test_a_well_formed_stream_applies_its_whiteouts_opaque_dirs_and_links(importer):
    """The positive control of every refusal below: a crafted stream in the exporter's
    format imports, and a fork sees its files, links, whiteouts and opaque directories."""
    backend, meta = importer
    assert host_has_lower_files()
    m0 = "L0/m0"
    members = opaque(base_members(m0), f"{m0}/usr/share/doc")
    members.append(reg(f"{m0}/usr/share/doc/only-this"))
    slot = await fork_of(backend, stream(meta, members), "fork")
    r = await bash(backend, slot, "cat /workspace/imported.txt /workspace/link; stat -c %h /workspace/hard; "
                                  "test -e /etc/debian_version || echo whiteout; ls -A /usr/share/doc; "
                                  "test -e /etc/hostname && echo lower-kept")
    assert r.output.split() == ["imported", "imported", "2", "whiteout", "only-this", "lower-kept"], r.output


async def test_a_redirect_record_never_shows_a_directory_hidden_from_slots(importer, hidden_home):
    """A ``trusted.overlay.redirect`` record (forks follow redirects: redirect_dir=follow)
    naming a host directory slots see empty shows nothing of it."""
    backend, meta = importer
    home, token = hidden_home
    m0 = "L0/m0"
    members = base_members(m0)
    members.append((entry(f"{m0}/workspace/peek", tarfile.DIRTYPE)[0], None))
    members[-1][0].pax_headers = xattr("trusted.overlay.redirect", os.fsencode(str(home)))
    members.append((entry(f"{m0}/workspace/peek2", tarfile.DIRTYPE)[0], None))
    members[-1][0].pax_headers = xattr("trusted.overlay.redirect", b"/root")
    # Positive control: the record is applied (a redirect to a directory slots do see
    # shows that directory's files).
    members.append((entry(f"{m0}/workspace/peek3", tarfile.DIRTYPE)[0], None))
    members[-1][0].pax_headers = xattr("trusted.overlay.redirect", b"/etc")
    slot = await fork_of(backend, stream(meta, members), "peek")
    r = await bash(backend, slot, "ls -A /workspace/peek /workspace/peek2 2>&1; "
                                  "cat /workspace/peek/canary 2>&1; cat /workspace/imported.txt; "
                                  "test -e /workspace/peek3/passwd && echo redirected")
    assert token not in r.output and "canary" not in r.output.replace("/workspace/peek/canary", ""), r.output
    assert r.output.endswith("imported\nredirected\n"), r.output  # the rest of the layer is there


def _hostile(m0: str, mark: str) -> dict[str, tuple[Callable[[list], list], str]]:
    """name -> (add the hostile member(s) to a well-formed layer, the refusal's message)."""
    return {
        "absolute name": (lambda ms: ms + [reg(f"/{m0}/workspace/{mark}")], "bad member name"),
        "dot-dot": (lambda ms: ms + [reg(f"{m0}/../../../../../../etc/{mark}")], "bad member name"),
        "dot-dot inside": (lambda ms: ms + [reg(f"{m0}/workspace/../../{mark}")], "bad member name"),
        "not a layer": (lambda ms: ms + [reg(f"etc/{mark}")], "bad member name"),
        "layer not a number": (lambda ms: ms + [reg(f"Lx/m0/{mark}")], f"bad member name 'Lx/m0/{mark}'"),
        "layer out of range": (lambda ms: ms + [reg(f"L9/m0/workspace/{mark}")], "outside the snapshot's layers"),
        "mount out of range": (lambda ms: ms + [reg(f"L0/m9/workspace/{mark}")], "outside the snapshot's layers"),
        "below its own link": (lambda ms: ms + [entry(f"{m0}/workspace/esc", tarfile.SYMTYPE, linkname="/etc"),
                                                reg(f"{m0}/workspace/esc/{mark}")], "below a symbolic link"),
        "a device": (lambda ms: ms + [entry(f"{m0}/workspace/{mark}", tarfile.CHRTYPE, devmajor=1, devminor=3)],
                     "is not a whiteout"),
        "a block device": (lambda ms: ms + [entry(f"{m0}/workspace/{mark}", tarfile.BLKTYPE, devmajor=8,
                                                  devminor=0)], "is not a whiteout"),
        "hard link out": (lambda ms: ms + [entry(f"{m0}/workspace/{mark}", tarfile.LNKTYPE,
                                                 linkname="/etc/passwd")], "not an earlier member"),
        "hard link forward": (lambda ms: ms + [entry(f"{m0}/workspace/{mark}", tarfile.LNKTYPE,
                                                     linkname=f"{m0}/workspace/later"),
                                               reg(f"{m0}/workspace/later")], "not an earlier member"),
    }


@pytest.mark.parametrize("case", list(_hostile("L0/m0", "x")))
async def test_each_hostile_member_is_refused(importer, case):
    backend, meta = importer
    mark = "hmt-import-" + secrets.token_hex(4)
    add, message = _hostile("L0/m0", mark)[case]
    # Positive control: the layer without the hostile member imports.
    await backend.import_snapshot(stream(meta, base_members("L0/m0")))
    with pytest.raises(SnapshotError, match=message):
        await backend.import_snapshot(stream(meta, add(base_members("L0/m0"))))
    # Nothing reached the host (a planted bug that drops a check writes there: clean up
    # before asserting); /etc/passwd is unchanged.
    reached = reached_host(mark)
    assert not reached, reached


async def test_a_bad_header_is_refused(importer):
    backend, meta = importer
    good = stream(meta, base_members("L0/m0"))
    await backend.import_snapshot(good)  # positive control
    cases = {
        "format": ({**meta, "format": 99}, "snapshot format 99"),
        "mounts": ({**meta, "mounts": ["/elsewhere"]}, "layer roots"),
        "layers": ({**meta, "layers": 0}, "bad layer count"),
        "layers type": ({**meta, "layers": "1"}, "bad layer count"),
    }
    for name, (bad, message) in cases.items():
        with pytest.raises(SnapshotError, match=message):
            await backend.import_snapshot(stream(bad, base_members("L0/m0")))
        assert name
    # The header must come first.
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info, data = reg("L0/m0/workspace/first")
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(SnapshotError, match="not a snapshot stream: it must start with hmt-snapshot.json"):
        await backend.import_snapshot(buf.getvalue())
