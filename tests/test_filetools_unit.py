"""The file tools' entry points (agent/files/filetools.py: ``read_file``, ``write_file``,
the listings and artifacts) on a real workspace tree, in process (milliseconds a test: the
mutation script runs these against every mutant; the same tools through a sandbox are in
test_shell.py).

The verdicts are the bytes on disk (read back with plain ``open``) and the exact page
metadata a caller is told to follow: paging each file by ``next_offset`` /
``next_byte_offset`` must return it exactly, whatever the page and chunk sizes, and every
partial page must say so. Bad arguments name the argument and the value.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from hermes_modal_tool.agent.files import filetools as ft
from hermes_modal_tool.agent.files.files import FileToolError, Workspace


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    (tmp_path / "slot_1").mkdir()
    return Workspace(str(tmp_path / "slot_1"), "/data/slot_1")


def put(w: Workspace, name: str, data: bytes) -> None:
    Path(w.host, name).write_bytes(data)


def pages(w: Workspace, path: str, output_limit: int, **args) -> tuple[bytes, list[dict]]:
    """Page through ``path`` as a caller is told to; ``(bytes, infos)``."""
    out, infos = b"", []
    while True:
        text, info = ft.read_file(w, dict(args, path=path), output_limit)
        infos.append(info)
        out += text.encode("utf-8", "surrogateescape") if args.get("encoding") != "base64" \
            else base64.b64decode(text)
        assert info["end_byte"] == len(out), (info, len(out))  # pages are contiguous from 0
        if not info["truncated"]:
            return out, infos
        assert len(infos) < 500, info
        args = dict(args, offset=info["next_offset"])
        args.pop("byte_offset", None)
        if info.get("next_byte_offset"):
            args["byte_offset"] = info["next_byte_offset"]


LINES = b"".join(b"line %d " % i + b"x" * (i % 13) + b"\n" for i in range(24))
LONG = b"head\n" + "\u00e9\u20acb\U0001f600".encode() * 12 + b"\ntail"  # one long line, multibyte


def test_a_small_file_is_one_whole_page(ws) -> None:
    put(ws, "a.txt", b"one\ntwo\nthree")  # no final newline: still three lines
    text, info = ft.read_file(ws, {"path": "a.txt"})
    assert text == "one\ntwo\nthree"
    assert info == {"path": "/data/slot_1/a.txt", "size": 13, "total_lines": 3, "first_line": 0,
                    "lines": 3, "encoding": "text", "end_byte": 13, "truncated": False,
                    "next_offset": None}
    put(ws, "b.txt", b"one\ntwo\n")
    text, info = ft.read_file(ws, {"path": "b.txt", "offset": None, "limit": None})
    assert (text, info["total_lines"], info["lines"], info["truncated"]) == ("one\ntwo\n", 2, 2, False)
    big = b"x" * 300 + b"\n" + b"y" * 300 + b"\nlast"  # offsets past the small-int cache
    put(ws, "big.txt", big)
    text, info = ft.read_file(ws, {"path": "big.txt"})
    assert text.encode() == big and info["truncated"] is False and info["next_offset"] is None
    assert (info["lines"], info["total_lines"], info["end_byte"]) == (3, 3, len(big))
    put(ws, "odd.txt", b"a\nb")  # one newline, then an unterminated line
    assert ft.read_file(ws, {"path": "odd.txt"})[1]["total_lines"] == 2
    put(ws, "empty", b"")
    text, info = ft.read_file(ws, {"path": "empty"})
    assert (text, info["total_lines"], info["lines"], info["end_byte"], info["truncated"]) == ("", 0, 0, 0, False)


def test_offset_and_limit_pick_lines_and_say_where_to_go_on(ws) -> None:
    put(ws, "a.txt", b"l0\nl1\nl2\nl3\nl4\n")
    text, info = ft.read_file(ws, {"path": "a.txt", "offset": 1, "limit": 2})
    assert text == "l1\nl2\n"
    assert (info["first_line"], info["lines"], info["truncated"], info["next_offset"]) == (1, 2, True, 3)
    assert info["end_byte"] == 9 and info["total_lines"] == 5
    text, info = ft.read_file(ws, {"path": "a.txt", "offset": 3, "limit": 2})  # reaches the end
    assert text == "l3\nl4\n" and info["truncated"] is False and info["next_offset"] is None
    text, info = ft.read_file(ws, {"path": "a.txt", "offset": 4, "limit": 1})
    assert text == "l4\n" and info["next_offset"] is None and info["lines"] == 1
    text, info = ft.read_file(ws, {"path": "a.txt", "offset": 5})  # just past the last line
    assert text == "" and info["lines"] == 0 and info["next_offset"] is None and not info["truncated"]
    text, info = ft.read_file(ws, {"path": "a.txt", "offset": 99})
    assert text == "" and info["end_byte"] == 15 and info["total_lines"] == 5
    text, info = ft.read_file(ws, {"path": "a.txt", "limit": 1})
    assert text == "l0\n" and info["next_offset"] == 1 and info["truncated"]


@pytest.mark.parametrize("chunk, budget", [(3, 9), (7, 4), (64, 40), (1 << 20, 50000)])
def test_paging_returns_every_file_exactly_whatever_the_page_and_chunk(ws, monkeypatch, chunk, budget) -> None:
    monkeypatch.setattr(ft, "READ_CHUNK", chunk)
    for name, data in (("lines", LINES), ("long", LONG), ("nl", b"\n\n\nx\n"), ("one", b"z")):
        put(ws, name, data)
        got, infos = pages(ws, name, budget)
        assert got == data, (name, infos[-1])
        assert infos[-1]["next_offset"] is None and not infos[-1]["truncated"]
        assert infos[-1]["end_byte"] == len(data), infos[-1]
        total = data.count(b"\n") + (0 if data.endswith(b"\n") else 1)
        for info in infos:
            assert info["total_lines"] == total and info["size"] == len(data), info
        for info in infos[:-1]:  # every partial page says where to go on, and keeps its cap
            assert info["truncated"] and info["next_offset"] is not None, info
        limited, _ = pages(ws, name, budget, limit=2)
        assert limited == data, name
    # Pages of whole lines end after a newline; a line longer than a page goes on inside it.
    _, infos = pages(ws, "lines", 40)
    assert all("next_byte_offset" not in i and "byte_offset" not in i for i in infos)
    if budget < 40:
        _, infos = pages(ws, "long", budget)
        inside = [i for i in infos if i.get("next_byte_offset")]
        assert inside and all(i["lines"] == 1 and i["next_offset"] == i["first_line"] for i in inside), infos


def test_a_page_cut_inside_a_line_keeps_utf8_characters_whole(ws) -> None:
    text = "\u00e9\u20ac\U0001f600" * 10  # 2-, 3- and 4-byte characters
    put(ws, "u.txt", text.encode())
    seen = []
    args = {"path": "u.txt"}
    while True:
        page, info = ft.read_file(ws, args, 10)
        assert "\ufffd" not in page, (page, info)  # never half a character
        assert len(page.encode()) <= 10 and page, info
        seen.append(page)
        if not info["truncated"]:
            break
        args = {"path": "u.txt", "offset": info["next_offset"], "byte_offset": info["next_byte_offset"]}
    assert "".join(seen) == text and len(seen) > 3
    _, info = ft.read_file(ws, {"path": "u.txt", "byte_offset": 9}, 4)
    assert info["byte_offset"] == 9 and info["next_byte_offset"] > 9


def test_char_boundary_and_newline_helpers() -> None:
    assert ft._char_boundary(b"ab") == 2 and ft._char_boundary(b"") == 0
    e, euro, face = "\u00e9".encode(), "\u20ac".encode(), "\U0001f600".encode()
    for ch in (e, euro, face, "\u00c0".encode(), "\U00010000".encode()):  # ...80 continuations
        for cut in range(1, len(ch)):
            assert ft._char_boundary(b"a" + ch[:cut]) == 1, (ch, cut)
        assert ft._char_boundary(b"a" + ch) == 1 + len(ch)
    assert ft._char_boundary(euro[:1]) == 1  # nothing before it: keep the byte (no empty page)
    assert ft._char_boundary(b"\x80\x80\x80\x80") == 4  # stray continuation bytes stay
    assert ft._after_nth(b"a\nb\nc", 1) == 2 and ft._after_nth(b"a\nb\nc", 2) == 4
    assert ft._after_nth_or_none(b"a\nb\n", 2) == 4 and ft._after_nth_or_none(b"a\nb\n", 3) is None
    assert ft._after_nth_or_none(b"\n", 1) == 1 and ft._after_nth_or_none(b"", 1) is None


def test_text_reads_see_the_first_max_read_bytes(ws, monkeypatch) -> None:
    monkeypatch.setattr(ft, "MAX_READ_BYTES", 12)
    monkeypatch.setattr(ft, "READ_CHUNK", 5)
    put(ws, "big", b"aaa\nbbb\nccc\nddd\neee\n")  # 20 bytes; text reads see 12
    text, info = ft.read_file(ws, {"path": "big"})
    assert text == "aaa\nbbb\nccc\n" and info["total_lines"] == 3 and info["end_byte"] == 12
    assert info["truncated"] and info["next_offset"] is None, info  # the rest is base64's
    text, info = ft.read_file(ws, {"path": "big", "offset": 3})
    assert text == "" and info["lines"] == 0 and info["truncated"]
    text, info = ft.read_file(ws, {"path": "big", "offset": 1, "limit": 5})
    assert text == "bbb\nccc\n" and info["next_offset"] is None


@pytest.mark.parametrize("chunk", [3, 1 << 20])
def test_byte_offset_past_its_line_is_refused_naming_it(ws, monkeypatch, chunk) -> None:
    monkeypatch.setattr(ft, "READ_CHUNK", chunk)  # the line may start chunks after the first
    put(ws, "a.txt", b"abc\ndefgh\nij\n")
    text, info = ft.read_file(ws, {"path": "a.txt", "offset": 1, "byte_offset": 5})
    assert text == "\nij\n" and info["byte_offset"] == 5
    with pytest.raises(FileToolError, match=r"byte_offset 6 is past the end of line 1 \(5 bytes long\)"):
        ft.read_file(ws, {"path": "a.txt", "offset": 1, "byte_offset": 6})
    with pytest.raises(FileToolError, match=r"byte_offset 3 is past the end of line 2 \(2 bytes long\)"):
        ft.read_file(ws, {"path": "a.txt", "offset": 2, "byte_offset": 3})
    with pytest.raises(FileToolError, match="byte_offset is for text reads"):
        ft.read_file(ws, {"path": "a.txt", "encoding": "base64", "byte_offset": 1})


def test_base64_reads_page_by_bytes_within_the_cap(ws) -> None:
    blob = bytes(range(256)) * 3
    put(ws, "b.bin", blob)
    text, info = ft.read_file(ws, {"path": "b.bin", "encoding": "base64"}, 400)
    assert base64.b64decode(text) == blob[:300] and len(text) <= 400
    assert info == {"path": "/data/slot_1/b.bin", "size": 768, "offset": 0, "bytes": 300,
                    "encoding": "base64", "end_byte": 300, "truncated": True, "next_offset": 300}
    text, info = ft.read_file(ws, {"path": "b.bin", "encoding": "base64", "offset": 700}, 400)
    assert base64.b64decode(text) == blob[700:] and not info["truncated"] and info["next_offset"] is None
    text, info = ft.read_file(ws, {"path": "b.bin", "encoding": "base64", "offset": 10, "limit": 5})
    assert base64.b64decode(text) == blob[10:15] and info["truncated"] is False  # the limit was met
    text, info = ft.read_file(ws, {"path": "b.bin", "encoding": "base64", "limit": 300})
    assert len(base64.b64decode(text)) == 300 and info["truncated"] is False and info["next_offset"] is None
    text, info = ft.read_file(ws, {"path": "b.bin", "encoding": "base64", "limit": 900}, 400)
    assert info["bytes"] == 300 and info["truncated"] and info["next_offset"] == 300
    text, info = ft.read_file(ws, {"path": "b.bin", "encoding": "base64"}, 1)  # at least 3 bytes
    assert base64.b64decode(text) == blob[:3]
    got, infos = pages(ws, "b.bin", 100, encoding="base64")
    assert got == blob
    assert [i["offset"] for i in infos][:3] == [0, 75, 150]


@pytest.mark.parametrize("args, word", [
    ({}, "missing required argument 'path'"),
    ({"path": ""}, "missing required argument 'path'"),
    ({"path": 3}, "missing required argument 'path'"),
    ({"path": "a.txt", "encoding": "rot13"}, "encoding must be 'text' or 'base64', got 'rot13'"),
    ({"path": "a.txt", "offset": -1}, "offset must be an integer from 0 to 4611686018427387904, got -1"),
    ({"path": "a.txt", "offset": True}, "offset must be an integer"),
    ({"path": "a.txt", "offset": "3"}, "offset must be an integer"),
    ({"path": "a.txt", "offset": 2 ** 62 + 1}, "offset must be an integer"),
    ({"path": "a.txt", "limit": 0}, "limit must be an integer from 1 to"),
    ({"path": "a.txt", "byte_offset": -2}, "byte_offset must be an integer from 0"),
])
def test_bad_read_arguments_are_named(ws, args, word) -> None:
    put(ws, "a.txt", b"x\n")
    with pytest.raises(FileToolError) as exc:
        ft.read_file(ws, args)
    assert word in str(exc.value), str(exc.value)


def test_the_largest_counts_are_accepted(ws) -> None:
    put(ws, "a.txt", b"x\ny\n")
    text, info = ft.read_file(ws, {"path": "a.txt", "offset": 2 ** 62, "limit": 2 ** 62})
    assert text == "" and info["first_line"] == 2 ** 62
    text, info = ft.read_file(ws, {"path": "a.txt", "limit": 1, "encoding": ""})
    assert (text, info["encoding"]) == ("x\n", "text")
    data, info = ft.read_artifact(ws, {"path": "a.txt", "offset": 10 ** 6})  # past the end
    assert data == "" and info["truncated"] is False and info["offset"] == 10 ** 6


def test_write_file_writes_appends_and_decodes(ws) -> None:
    out, info = ft.write_file(ws, {"path": "w.txt", "content": "h\u00e9\n"})
    assert out == "wrote 4 bytes to /data/slot_1/w.txt" and info == {"path": "/data/slot_1/w.txt", "bytes": 4}
    out, info = ft.write_file(ws, {"path": "w.txt", "content": "more", "append": True})
    assert out == "appended 4 bytes to /data/slot_1/w.txt"
    assert Path(ws.host, "w.txt").read_bytes() == "h\u00e9\nmore".encode()
    out, _ = ft.write_file(ws, {"path": "w.txt", "content": "new", "append": False})
    assert Path(ws.host, "w.txt").read_bytes() == b"new" and out.startswith("wrote 3 ")
    blob = bytes(range(256))
    ft.write_file(ws, {"path": "b.bin", "content": base64.b64encode(blob).decode(), "encoding": "base64"})
    assert Path(ws.host, "b.bin").read_bytes() == blob
    ft.write_file(ws, {"path": "s.txt", "content": "\ud800"})  # a lone surrogate is kept as such
    assert Path(ws.host, "s.txt").read_bytes() == b"\xed\xa0\x80"


@pytest.mark.parametrize("args, word", [
    ({"path": "w.txt"}, "missing required argument 'content'"),
    ({"path": "w.txt", "content": b"x"}, "missing required argument 'content'"),
    ({"content": "x"}, "missing required argument 'path'"),
    ({"path": "w.txt", "content": "x", "append": "yes"}, "append must be true or false, got 'yes'"),
    ({"path": "w.txt", "content": "%%%", "encoding": "base64"}, "content is not valid base64"),
    ({"path": "w.txt", "content": "\u00e9", "encoding": "base64"}, "content is not valid base64"),
    ({"path": "w.txt", "content": "x", "encoding": "hex"}, "encoding must be"),
])
def test_bad_write_arguments_are_named_and_write_nothing(ws, args, word) -> None:
    with pytest.raises(FileToolError) as exc:
        ft.write_file(ws, args)
    assert word in str(exc.value), str(exc.value)
    assert not Path(ws.host, "w.txt").exists()


def test_listings_mark_directories_cap_entries_and_escape_names(ws) -> None:
    host = Path(ws.host)
    (host / "sub").mkdir()
    (host / "sub" / "deep.txt").write_text("d")
    (host / "a.txt").write_text("aa")
    raw = b"r\xff.txt"
    with open(os.path.join(os.fsencode(ws.host), raw), "wb") as fh:
        fh.write(b"x")
    out, info = ft.list_files(ws, {})
    assert out.splitlines() == ["a.txt", "r\\xff.txt", "sub/"] and not info["truncated"]
    escaped = [e for e in info["entries"] if "raw_path" in e]
    assert len(escaped) == 1 and base64.b64decode(escaped[0]["raw_path"]) == raw
    assert all("raw_path" not in e for e in info["entries"] if e is not escaped[0])
    out, info = ft.list_files(ws, {"recursive": True, "max_entries": 2})
    assert out.splitlines() == ["a.txt", "r\\xff.txt", "... (more than 2 entries)"] and info["truncated"]
    out, info = ft.list_files(ws, {"path": "sub", "recursive": True})
    assert out == "deep.txt" and info["path"] == "/data/slot_1/sub"
    out, info = ft.list_artifacts(ws, {"recursive": True})
    assert info["entries"] == ["a.txt", "r\\xff.txt", "sub/deep.txt"] and out.splitlines() == info["entries"]
    assert {d["path"] for d in info["details"]} >= {"sub", "sub/deep.txt"} and not info["truncated"]
    _, info = ft.list_artifacts(ws, {})
    assert info["entries"] == ["a.txt", "r\\xff.txt", "sub"]
    _, info = ft.list_artifacts(ws, {"max_entries": 1})
    assert info["entries"] == ["a.txt"] and info["truncated"]
    with pytest.raises(FileToolError, match="max_entries must be an integer from 1"):
        ft.list_files(ws, {"max_entries": 0})


def test_read_artifact_caps_offsets_and_hashes(ws) -> None:
    data = b"0123456789" * 10
    put(ws, "r.bin", data)
    content, info = ft.read_artifact(ws, {"path": "r.bin"}, 30)  # the output cap in bytes
    assert content == data[:30].decode() and info["truncated"] and info["size"] == 100
    content, info = ft.read_artifact(ws, {"path": "r.bin", "max_bytes": 1000}, 30)
    assert content == data.decode() and info["truncated"] is False and "sha256" not in info
    content, info = ft.read_artifact(ws, {"path": "r.bin", "offset": 95, "include_sha256": True})
    assert content == "56789" and info["offset"] == 95 and not info["truncated"]
    assert info["sha256"] == hashlib.sha256(b"56789").hexdigest()
    content, info = ft.read_artifact(ws, {"path": "r.bin", "encoding": "base64", "max_bytes": 4})
    assert base64.b64decode(content) == b"0123" and info["encoding"] == "base64" and info["truncated"]
    assert info["content"] == content and info["path"] == "/data/slot_1/r.bin"
    # An offset past the end, even past what the file system can seek to, is an empty page.
    for offset in (100, 10**6, 2**62):
        content, info = ft.read_artifact(ws, {"path": "r.bin", "offset": offset})
        assert content == "" and info["size"] == 100 and not info["truncated"], (offset, info)


def test_archive_artifacts_holds_the_files(ws) -> None:
    host = Path(ws.host)
    (host / "out").mkdir()
    (host / "out" / "r.txt").write_text("result")
    text, info = ft.archive_artifacts(ws, {"path": "out"})
    blob = base64.b64decode(info["archive_base64"])
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        names = tar.getnames()
        member = next(m for m in tar.getmembers() if m.name.endswith("r.txt"))
        assert tar.extractfile(member).read() == b"result"
    assert info["format"] == "tar.gz" and info["bytes"] == len(blob) and info["entries"] == len(names)
    assert text == f"archived {len(names)} entries of /data/slot_1/out ({len(blob)} bytes, tar.gz)"
    _, whole = ft.archive_artifacts(ws, {"archive_format": None})
    assert whole["path"] == "/data/slot_1" and whole["format"] == "tar.gz"
    with pytest.raises(FileToolError, match="max_bytes must be an integer from 1"):
        ft.archive_artifacts(ws, {"max_bytes": 0})


def test_every_tool_is_registered() -> None:
    assert ft.TOOLS == {"read_file": ft.read_file, "write_file": ft.write_file,
                        "list_files": ft.list_files, "read_artifact": ft.read_artifact,
                        "list_artifacts": ft.list_artifacts, "archive_artifacts": ft.archive_artifacts}
