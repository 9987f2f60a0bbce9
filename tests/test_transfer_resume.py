"""Resumed directory transfers (``resume=True``): a directory upload or download cut off
midway is finished by sending only what the other end lacks: files complete and
checksum-equal are kept, the file cut short is continued from its offset, and a file
that differs is sent again (never kept by its name or size alone)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
from pathlib import Path

import pytest
from support import bash

from hermes_modal_tool import TransferError, _transfer_tree, _transfer_wire

FIRST = os.urandom(200_000)
BIG = os.urandom(3_000_000)  # a tar member is written in 1 MiB pieces: the cut leaves 1-2 MiB


def make_tree(top: Path) -> None:
    (top / "a").mkdir(parents=True)
    (top / "b").mkdir()
    (top / "c").mkdir()
    (top / "a" / "first.bin").write_bytes(FIRST)
    (top / "b" / "big.bin").write_bytes(BIG)
    (top / "b" / "big.bin").chmod(0o640)
    (top / "c" / "after.txt").write_text("after")
    (top / "c" / "link").symlink_to("../a/first.bin")


def tree_of(top: Path) -> dict[str, tuple[str, int]]:
    """{name: (sha256 or link target, mode)} of every entry below ``top``."""
    out = {}
    for p in sorted(top.rglob("*")):
        rel = str(p.relative_to(top))
        if p.is_symlink():
            out[rel] = ("-> " + os.readlink(p), 0)
        elif p.is_file():
            out[rel] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mode & 0o777)
        else:
            out[rel] = ("dir", 0)
    return out


async def slot_tree(backend, slot, remote: str) -> dict[str, tuple[str, int]]:
    r = await bash(backend, slot, f"(cd {remote} && find . -mindepth 1 | sort | while read -r p; do "
                                  "if [ -L \"$p\" ]; then echo \"${p#./}|-> $(readlink \"$p\")|0\"; "
                                  "elif [ -f \"$p\" ]; then echo \"${p#./}|$(sha256sum < \"$p\" | cut -c1-64)|"
                                  "$(stat -c %a \"$p\")\"; else echo \"${p#./}|dir|0\"; fi; done)")
    assert r.success, r.output
    out = {}
    for line in r.output.splitlines():
        rel, what, mode = line.split("|")
        out[rel] = (what, int(mode, 8))
    return out


def cut_after(monkeypatch, requests: int, **match: object) -> None:
    """The link fails at the ``requests``-th chunk request matching ``match`` (a transfer
    cut off midway, as a dropped connection or a cancelled caller leaves it): a download's
    chunk requests go through ``_transfer_wire._ask``, an upload's through ``_put``."""
    real_ask, real_put = _transfer_wire._ask, _transfer_wire._put
    seen = [0]

    def cut(message) -> bool:
        if all(message.get(k) == v for k, v in match.items()) and "stream" in message \
                and not message.get("abort") and not message.get("end"):
            seen[0] += 1
            return seen[0] >= requests
        return False

    async def ask(sb, message, what):
        if cut(message):
            raise TransferError("the link was cut (test)")
        return await real_ask(sb, message, what)

    def put(sb, message, what):
        if cut(message):
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(TransferError("the link was cut (test)"))
            return fut
        return real_put(sb, message, what)

    monkeypatch.setattr(_transfer_wire, "_ask", ask)
    monkeypatch.setattr(_transfer_wire, "_put", put)


async def test_an_interrupted_directory_upload_resumes(make_backend, tmp_path, monkeypatch):
    backend = await make_backend()
    slot = await backend.acquire("t")
    src = tmp_path / "src"
    make_tree(src)
    monkeypatch.setattr(_transfer_tree, "CHUNK_BYTES", 64 * 1024)
    with monkeypatch.context() as m:
        cut_after(m, 30, op="upload")  # ~1.8 MB of 64 KiB chunks
        with pytest.raises(TransferError):
            await backend.upload(slot, src, "dst")
    # Positive control: the cut left the first file whole and the big one partial.
    r = await bash(backend, slot, "stat -c %s dst/a/first.bin dst/b/big.bin; "
                                  "test -e dst/c/after.txt && echo 1 || echo 0")
    first_size, partial, after = (int(x) for x in r.output.split())
    assert first_size == len(FIRST) and 0 < partial < len(BIG) and after == 0, r.output

    done = await backend.upload(slot, src, "dst", resume=True)
    assert await slot_tree(backend, slot, "dst") == tree_of(src)
    assert done.kept == 1 and done.files == 2  # first kept; big continued, after.txt sent
    assert done.bytes == len(BIG) - partial + len("after")
    assert done.size == len(FIRST) + len(BIG) + len("after")

    # Negative control: a file changed at the same size, and a partial file whose bytes
    # are not the local file's first ones, are both sent whole, not kept or continued.
    (src / "a" / "first.bin").write_bytes(os.urandom(len(FIRST)))
    assert (await bash(backend, slot, "head -c 1000 /dev/urandom > dst/b/big.bin")).success
    again = await backend.upload(slot, src, "dst", resume=True)
    assert await slot_tree(backend, slot, "dst") == tree_of(src)
    assert again.kept == 1 and again.bytes == len(FIRST) + len(BIG)  # after.txt kept


async def test_an_interrupted_directory_download_resumes(make_backend, tmp_path, monkeypatch):
    backend = await make_backend()
    slot = await backend.acquire("t")
    src = tmp_path / "src"
    make_tree(src)
    await backend.upload(slot, src, "tree")
    back = tmp_path / "back"
    with monkeypatch.context() as m:
        cut_after(m, 10, op="download")  # ~2.3 MB of 256 KiB chunks
        with pytest.raises(TransferError):
            await backend.download(slot, "tree", back)
    # Positive control: the first file whole, the big one partial, the last not yet made.
    partial = (back / "b" / "big.bin").stat().st_size
    assert (back / "a" / "first.bin").read_bytes() == FIRST and 0 < partial < len(BIG)
    assert not (back / "c").exists()

    done = await backend.download(slot, "tree", back, resume=True)
    assert tree_of(back) == tree_of(src)
    assert done.kept == 1 and done.files == 2
    assert done.bytes == len(BIG) - partial + len("after")

    # Negative control: the slot's file changed (same size), and a local partial file
    # whose bytes differ: both fetched whole.
    assert (await bash(backend, slot, "head -c 200000 /dev/urandom > tree/a/first.bin")).success
    (back / "b" / "big.bin").write_bytes(os.urandom(1000))
    again = await backend.download(slot, "tree", back, resume=True)
    assert tree_of(back) == await slot_tree(backend, slot, "tree")
    assert again.kept == 1 and again.bytes == len(FIRST) + len(BIG)


async def test_a_file_resumes_without_an_offset_given(make_backend, tmp_path):
    """``resume=True`` on a file finds the offset itself: nothing moves when the two are
    equal, the rest when one holds the other's first bytes, all of it when they differ."""
    backend = await make_backend()
    slot = await backend.acquire("t")
    data = os.urandom(700_000)
    local = tmp_path / "f.bin"
    local.write_bytes(data)
    await backend.upload(slot, data[:300_000], "f.bin")  # an upload cut short
    done = await backend.upload(slot, local, "f.bin", resume=True)
    assert (done.bytes, done.size, done.sha256) == (400_000, 700_000, hashlib.sha256(data).hexdigest())
    again = await backend.upload(slot, local, "f.bin", resume=True)
    assert (again.bytes, again.kept) == (0, 1)  # equal: nothing sent
    other = os.urandom(700_000)  # negative control: same size, other bytes: all of it again
    local.write_bytes(other)
    changed = await backend.upload(slot, local, "f.bin", resume=True)
    assert changed.bytes == 700_000 and changed.sha256 == hashlib.sha256(other).hexdigest()
    r = await bash(backend, slot, "sha256sum f.bin | cut -c1-64")
    assert r.output.strip() == changed.sha256

    back = tmp_path / "back.bin"
    back.write_bytes(other[:123_456])  # a download cut short
    down = await backend.download(slot, "f.bin", back, resume=True)
    assert down.bytes == 700_000 - 123_456 and back.read_bytes() == other
    back.write_bytes(b"x" * 1000)  # its first bytes differ: fetched whole
    whole = await backend.download(slot, "f.bin", back, resume=True)
    assert whole.bytes == 700_000 and back.read_bytes() == other


async def test_resume_arguments_are_clear(make_backend, tmp_path):
    backend = await make_backend()
    slot = await backend.acquire("t")
    with pytest.raises(ValueError, match="resume=True needs a local file or directory path"):
        await backend.upload(slot, b"abc", "f.bin", resume=True)
    with pytest.raises(ValueError, match="not both"):
        await backend.upload(slot, tmp_path, "d", offset=3, resume=True)
    with pytest.raises(ValueError, match="resume=True needs a local file or directory path"):
        await backend.download(slot, "f.bin", io.BytesIO(), resume=True)
    (tmp_path / "f.bin").write_bytes(b"abc")
    # A directory the slot does not have yet: everything is sent (nothing to keep).
    done = await backend.upload(slot, tmp_path, "new/dir", resume=True)
    assert done.kept == 0 and done.files == 1

async def test_a_write_that_fails_fails_the_upload_though_its_chunk_was_answered(make_backend):
    """Chunks of a file upload are answered as they arrive (``streamin.AHEAD_BYTES``, here
    both chunks), so a write that fails is told to a later chunk or to the end: the upload
    still fails, with the file system's reason."""
    backend = await make_backend(slot_disk=16)
    slot = await backend.acquire("t")
    data = os.urandom(1_500_000)  # two chunks, both answered on arrival
    r = await bash(backend, slot, "dd if=/dev/zero of=fill bs=1M count=64 2>&1; sync")
    assert "No space" in r.output or "quota" in r.output.lower(), r.output
    with pytest.raises(TransferError, match="(?i)no space|quota"):
        await backend.upload(slot, data, "big.bin")
    assert (await bash(backend, slot, "rm -f fill big.bin")).success
    ok = await backend.upload(slot, data, "big.bin")  # positive control: with room, it goes
    assert ok.size == len(data)
