"""Data in, data out, and what it cost, on both drivers (Modal: the local control plane):
a file uploaded into a slot and downloaded back is the same bytes, each move is an
``upload``/``download`` span, and the release's usage counts the trajectory's calls."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import stat
import tarfile

import pytest
from support import bash
from test_tracing import spans  # noqa: F401  (the in-memory span exporter fixture)

from hermes_modal_tool import TransferError, filetransfer


async def test_transfer_spans_and_usage_on_each_driver(driver_backend, spans, tmp_path):  # noqa: F811
    data = os.urandom(1_500_000)  # several chunks
    (tmp_path / "in.bin").write_bytes(data)
    backend = await driver_backend(slots_per_sandbox=2)
    slot = await backend.acquire("traj-data")
    up = await backend.upload(slot, str(tmp_path / "in.bin"), "in.bin")
    r = await bash(backend, slot, "sha256sum in.bin | cut -c1-64; cp in.bin out.bin")
    assert r.output.strip() == hashlib.sha256(data).hexdigest() == up.sha256, r  # the slot's verdict
    down = await backend.download(slot, "out.bin", str(tmp_path / "out.bin"))
    assert (tmp_path / "out.bin").read_bytes() == data and down.bytes == len(data)
    used = await backend.release(slot)
    assert used.calls.get("bash") == 1 and used.wall_s > 0, used
    names = {s.name: s for s in spans.get_finished_spans()}
    upload, download = names["hermes_modal_tool.upload"], names["hermes_modal_tool.download"]
    assert upload.attributes["hmt.bytes"] == len(data) and upload.attributes["hmt.slot_id"] == slot.slot_id
    assert download.attributes["hmt.sha256"] == up.sha256


# -- streamed transfer on both drivers: big files, trees, hostile tars, neighbours -----------

def hostile_tars(outside: str) -> dict[str, bytes]:
    """Tar streams the unpacker must refuse, each after a benign ``ok.txt`` (the positive
    control: the stream was read and written up to the hostile member). ``outside`` is an
    absolute path of a host directory holding ``canary.txt``."""
    def tar_of(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            ok = tarfile.TarInfo("ok.txt")
            ok.size = 2
            tar.addfile(ok, io.BytesIO(b"ok"))
            for info, data in members:
                if data is not None:
                    info.size = len(data)
                tar.addfile(info, io.BytesIO(data) if data is not None else None)
        return buf.getvalue()

    def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.mode = kind, link, 0o644
        return info

    canary = outside.rstrip("/") + "/canary.txt"
    up = "../" * 40
    dev = member("null", tarfile.CHRTYPE)
    dev.devmajor, dev.devminor = 1, 3
    return {
        "absolute name": tar_of((member(canary), b"pwned")),
        "dot-dot": tar_of((member(up + canary.lstrip("/")), b"pwned")),
        "symlink then file through it": tar_of((member("esc", tarfile.SYMTYPE, outside), None),
                                               (member("esc/canary.txt"), b"pwned")),
        "inner symlink then file through it": tar_of((member("d", tarfile.DIRTYPE), None),
                                                     (member("in", tarfile.SYMTYPE, "d"), None),
                                                     (member("in/x.txt"), b"through")),
        "hard link to outside": tar_of((member("h", tarfile.LNKTYPE, up + canary.lstrip("/")), None),
                                       (member("h"), b"pwned")),
        "device node": tar_of((dev, None)),
    }


def canary_state(path) -> tuple[bytes, int]:
    return path.read_bytes(), stat.S_IMODE(path.stat().st_mode)


async def test_a_large_file_round_trips_byte_exact_while_a_neighbour_runs(driver_backend, tmp_path):
    backend = await driver_backend(slots_per_sandbox=2, slot_disk=256)
    big, neighbour = await backend.acquire("big"), await backend.acquire("neighbour")
    data = os.urandom(48 * 2**20 + 3)  # 48 MiB and a bit: many chunks, the last one short
    (tmp_path / "in.bin").write_bytes(data)
    assert (await bash(backend, neighbour, "echo warm")).success  # its shell is up
    upload = asyncio.ensure_future(backend.upload(big, str(tmp_path / "in.bin"), "d/in.bin"))
    # The neighbour's command completes while the transfer still runs: the sandbox's loop
    # is not held by the transfer (its chunks are written in a thread of their own).
    during = 0
    while not upload.done():
        r = await asyncio.wait_for(bash(backend, neighbour, "echo hi"), 60)
        assert r.output == "hi\n", r
        during += not upload.done()
    up = await upload
    assert during >= 1, "no neighbour command completed during the upload"
    r = await bash(backend, big, "sha256sum d/in.bin | cut -c1-64; stat -c %s d/in.bin", timeout=300)
    assert r.output.split() == [hashlib.sha256(data).hexdigest(), str(len(data))] == [up.sha256, str(up.size)]
    out = tmp_path / "out.bin"
    down = await backend.download(big, "d/in.bin", str(out))
    assert out.read_bytes() == data and down.sha256 == up.sha256  # the host's verdict
    used = await backend.usage(big)
    assert used.calls.get("upload") == 1 and used.calls.get("download") == 1, used


async def test_a_directory_round_trips_as_a_tree(driver_backend, tmp_path):
    backend = await driver_backend(slots_per_sandbox=2)
    slot = await backend.acquire("tree")
    src = tmp_path / "src"
    (src / "sub" / "deep").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "run.sh").write_text("#!/bin/sh\necho run\n")
    (src / "run.sh").chmod(0o755)
    (src / "sub" / "secret").write_text("s")
    (src / "sub" / "secret").chmod(0o600)
    (src / "sub" / "deep" / "f.txt").write_bytes(os.urandom(3 * 2**20))  # several chunks of the stream
    (src / "sub").chmod(0o750)
    (src / "to_f").symlink_to("sub/deep/f.txt")  # inside: kept as a link
    (src / "to_sub").symlink_to("sub")  # a link to a directory: a link, never followed
    (src / "out").symlink_to("/etc/hostname")  # leads out: left out, counted
    up = await backend.upload(slot, str(src), "t")
    assert (up.files, up.skipped) == (3, 1), up
    r = await bash(backend, slot, "(cd t && find . -printf '%p %y %m %l\\n' | sort)")
    assert r.output.splitlines() == [
        ". d 755 ", "./empty d 755 ", "./run.sh f 755 ", "./sub d 750 ", "./sub/deep d 755 ",
        "./sub/deep/f.txt f 644 ", "./sub/secret f 600 ", "./to_f l 777 sub/deep/f.txt",
        "./to_sub l 777 sub"], r.output
    # The slot adds its own: a link out (left out on the way back) and one inside.
    assert (await bash(backend, slot, "ln -s /etc/shadow t/evil && ln -s ../t/run.sh t/sub/up")).success
    back = tmp_path / "back"
    down = await backend.download(slot, "t", str(back))
    assert (down.files, down.skipped) == (3, 1), down
    found = {str(p.relative_to(back)): p for p in back.rglob("*")}
    assert sorted(found) == ["empty", "run.sh", "sub", "sub/deep", "sub/deep/f.txt", "sub/secret",
                             "sub/up", "to_f", "to_sub"]
    assert os.readlink(back / "to_sub") == "sub" and os.readlink(back / "sub" / "up") == "../t/run.sh"
    assert os.readlink(back / "to_f") == "sub/deep/f.txt" and not (back / "evil").is_symlink()
    assert (back / "sub" / "deep" / "f.txt").read_bytes() == (src / "sub" / "deep" / "f.txt").read_bytes()
    modes = {k: stat.S_IMODE(os.lstat(p).st_mode) for k, p in found.items() if not p.is_symlink()}
    assert modes == {"empty": 0o755, "run.sh": 0o755, "sub": 0o750, "sub/deep": 0o755,
                     "sub/deep/f.txt": 0o644, "sub/secret": 0o600}


async def test_a_hostile_tar_is_refused_in_the_slot_and_writes_nothing_outside(driver_backend, tmp_path):
    backend = await driver_backend(slots_per_sandbox=2)
    slot = await backend.acquire("hostile")
    canary = tmp_path / "canary.txt"
    canary.write_bytes(b"canary")
    canary.chmod(0o600)
    before = canary_state(canary)
    for i, (name, tar) in enumerate(hostile_tars(str(tmp_path)).items()):
        async def chunks(tar=tar):
            yield tar
        with pytest.raises(TransferError, match="refused|leads out|climbs out|absolute|below|not an earlier"):
            await filetransfer.upload_tar_stream(backend, slot, chunks(), f"in{i}", name)
        assert canary_state(canary) == before, name  # the host's verdict
        r = await bash(backend, slot, f"cat in{i}/ok.txt; echo; ls -A in{i} in{i}/d 2>/dev/null")
        assert r.output.startswith("ok\n"), (name, r.output)  # the stream was read up to there
        names = {w for w in r.output.split()[1:] if not w.endswith(":")}
        assert names <= {"ok.txt", "d", "in"}, (name, r.output)  # nothing past the refusal
