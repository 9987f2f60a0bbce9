"""Streamed transfer: upload/download of files and directories in chunks over the
sandbox's stream, checksummed on both ends, resumable from an offset, written through
the slot's own view with its credentials."""

from __future__ import annotations

import hashlib
import io
import os

import pytest
from support import bash

from hermes_modal_tool import Transfer, TransferError, filetransfer
from hermes_modal_tool._transfer_probe import stream_speed


@pytest.fixture
def small_chunks(monkeypatch):
    """Several chunks and a pipeline even for small test files."""
    monkeypatch.setattr(filetransfer, "CHUNK_BYTES", 64 * 1024)


async def test_a_file_goes_up_and_comes_back_byte_for_byte(make_backend, tmp_path, small_chunks):
    backend = await make_backend()
    slot = await backend.acquire("t")
    data = os.urandom(1_000_003)  # 16 chunks and a bit
    (tmp_path / "in.bin").write_bytes(data)
    up = await backend.upload(slot, tmp_path / "in.bin", "sub/dir/in.bin")
    assert isinstance(up, Transfer) and up.bytes == up.size == len(data)
    assert up.sha256 == hashlib.sha256(data).hexdigest()
    # The slot's own view: same bytes, owned like a file the slot's shell makes (the
    # slot's user, not the host's root, which would show as nobody).
    r = await bash(backend, slot, "sha256sum sub/dir/in.bin | cut -c1-64; touch mine; "
                                  "stat -c %u sub/dir/in.bin mine")
    digest, owner, mine = r.output.split()
    assert digest == up.sha256 and owner == mine
    out = io.BytesIO()
    down = await backend.download(slot, "sub/dir/in.bin", out)
    assert out.getvalue() == data and down.sha256 == up.sha256 and down.bytes == len(data)


async def test_resume_from_an_offset_and_a_wrong_one_is_refused(make_backend, tmp_path, small_chunks):
    backend = await make_backend()
    slot = await backend.acquire("t")
    data = os.urandom(300_000)
    await backend.upload(slot, data[:100_000], "r.bin")  # an upload cut short
    done = await backend.upload(slot, io.BytesIO(data), "r.bin", offset=100_000)
    assert done.bytes == 200_000 and done.sha256 == hashlib.sha256(data).hexdigest()
    # The slot's file no longer holds exactly the first 100,000 bytes: refused, unchanged.
    with pytest.raises(TransferError, match="cannot resume at offset 100000"):
        await backend.upload(slot, data, "r.bin", offset=100_000)
    local = tmp_path / "r.bin"
    local.write_bytes(data[:123_456] + b"junk past the offset")
    back = await backend.download(slot, "r.bin", local, offset=123_456)
    assert back.bytes == 300_000 - 123_456 and local.read_bytes() == data
    r = await bash(backend, slot, "sha256sum r.bin | cut -c1-64")
    assert r.output.strip() == done.sha256


async def test_a_checksum_mismatch_is_an_error(make_backend, monkeypatch):
    backend = await make_backend()
    slot = await backend.acquire("t")
    assert (await backend.upload(slot, b"abc", "c.bin")).size == 3  # positive control
    real = filetransfer.wire._ask

    async def corrupted(sb, message, what):  # the slot's end saw other bytes
        got = await real(sb, message, what)
        return dict(got, sha256="0" * 64) if "sha256" in got else got

    monkeypatch.setattr(filetransfer.wire, "_ask", corrupted)
    with pytest.raises(TransferError, match="checksum differs after the upload"):
        await backend.upload(slot, b"abcdef", "c.bin")
    with pytest.raises(TransferError, match="checksum differs after the download"):
        await backend.download(slot, "c.bin", io.BytesIO())


async def test_a_directory_round_trip(make_backend, tmp_path):
    backend = await make_backend()
    slot = await backend.acquire("t")
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "a" / "b" / "f.txt").write_text("deep")
    (src / "top.txt").write_text("top")
    (src / "link").symlink_to("/etc/hostname")  # links are left out
    up = await backend.upload(slot, src, "tree")
    assert (up.files, up.bytes, up.skipped) == (2, 7, 1)
    r = await bash(backend, slot, "(cd tree && find . | sort)")
    assert r.output.split() == [".", "./a", "./a/b", "./a/b/f.txt", "./empty", "./top.txt"]
    # The slot adds a link to a host file it would like the host to copy out.
    assert (await bash(backend, slot, "ln -s /etc/shadow tree/evil")).success
    back = tmp_path / "back"
    down = await backend.download(slot, "tree", back)
    assert down.files == 2
    assert sorted(str(p.relative_to(back)) for p in back.rglob("*")) == [
        "a", "a/b", "a/b/f.txt", "empty", "top.txt"]
    assert (back / "a" / "b" / "f.txt").read_text() == "deep"
    assert not (back / "evil").exists() and not (back / "evil").is_symlink()


async def test_bad_arguments_are_clear(make_backend):
    backend = await make_backend()
    slot = await backend.acquire("t")
    with pytest.raises(TransferError, match="missing.bin"):
        await backend.download(slot, "missing.bin", io.BytesIO())
    with pytest.raises(ValueError, match="offset must be"):
        await backend.upload(slot, b"x", "x.bin", offset=-1)
    with pytest.raises(ValueError, match="takes a local path, bytes or a binary file object"):
        await backend.upload(slot, 42, "x.bin")


async def test_the_stream_probe_moves_every_byte_both_ways(make_backend):
    """The benchmark's ``stream`` row: the probe's bytes are counted at both ends (a short
    or long count is a TransferError), and a bad size is refused by the host and the agent."""
    backend = await make_backend()
    slot = await backend.acquire("t")
    speed = await stream_speed(backend, slot, 3 * 2**20 + 5)  # 12 chunks and a short one
    assert speed["up_MBps"] > 0 and speed["down_MBps"] > 0
    with pytest.raises(ValueError, match="nbytes must be a whole number > 0, got 0"):
        await stream_speed(backend, slot, 0)
    sb, index = filetransfer.wire._where(backend, slot)
    with pytest.raises(TransferError, match="needs a slot of this sandbox and a size >= 0, got slot .* size -1"):
        await filetransfer.wire._ask(sb, {"op": "download", "slot": index, "kind": "probe", "size": -1}, "probe")
    assert (await bash(backend, slot, "echo alive")).output == "alive\n"
