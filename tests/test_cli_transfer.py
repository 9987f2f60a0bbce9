"""``batch`` steps that move files: ``upload`` into the trajectory's slot and ``download``
out of it (files and directories), checked on the host's side; a failed transfer is a
failed step, and bad transfer arguments are refused before anything starts."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from cli_helpers import bash, run, write_jsonl


def test_batch_uploads_and_downloads_files_and_directories(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # local paths are relative to the current directory, as cp's
    data = os.urandom(300_000)  # more than one chunk's worth of base64 lines
    (tmp_path / "in.bin").write_bytes(data)
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "tree" / "sub" / "x.txt").write_text("x\n")
    batch = write_jsonl(tmp_path / "batch.jsonl", [{"id": "t", "calls": [
        {"tool": "upload", "args": {"local": "in.bin", "remote": "data/in.bin"}},
        {"tool": "upload", "args": {"local": "tree", "remote": "tree"}},
        bash("sha256sum data/in.bin | cut -c1-64; cat tree/sub/x.txt; "
             "mkdir -p out/d && echo made-in-slot > out/d/y.txt && cp data/in.bin out/copy.bin",
             output_contains=hashlib.sha256(data).hexdigest() + "\nx\n", returncode=0),
        {"tool": "download", "args": {"remote": "out", "local": "got"}},
        {"tool": "download", "args": {"remote": "nope.txt", "local": "nope.txt"},
         "expect": {"success": False}},
    ]}])
    result = run("batch", str(batch), "-o", "results.jsonl", "--no-progress")
    assert result.exit_code == 0, result.output
    (record,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert record["ok"], record
    up = record["steps"][0]
    assert up["tool"] == "upload" and up["success"] and str(len(data)) in up["output"]
    assert (tmp_path / "got" / "copy.bin").read_bytes() == data  # the host's verdict
    assert (tmp_path / "got" / "d" / "y.txt").read_text() == "made-in-slot\n"
    missing = record["steps"][4]
    assert not missing["success"] and "nope.txt" in missing["error"]
    assert not (tmp_path / "nope.txt").exists()


def test_bad_transfer_steps_are_refused_before_anything_starts(tmp_path: Path) -> None:
    for args, words in [({"local": "a"}, "'remote' must be a non-empty path"),
                        ({"local": "a", "remote": "b", "mode": 1}, "unknown argument(s) 'mode'")]:
        batch = write_jsonl(tmp_path / "bad.jsonl", [{"id": "t", "calls": [
            {"tool": "upload", "args": args}]}])
        result = run("batch", str(batch), "--no-progress")
        assert result.exit_code == 2 and words in result.output and "line 1" in result.output, result.output


def test_a_transfer_step_resumes_what_an_earlier_one_left(tmp_path: Path, monkeypatch) -> None:
    """``"resume": true``: a file the slot holds whole is kept, one it holds the start of
    goes on from there; without it (the control) everything is sent again."""
    monkeypatch.chdir(tmp_path)
    big = os.urandom(700_000)
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "big.bin").write_bytes(big)
    (tmp_path / "tree" / "small.txt").write_text("small\n")
    cut = "head -c 100000 tree/big.bin > cut && cat cut > tree/big.bin && rm cut"  # same inode, same mode
    batch = write_jsonl(tmp_path / "batch.jsonl", [{"id": "t", "calls": [
        {"tool": "upload", "args": {"local": "tree", "remote": "tree"}},
        bash(cut, returncode=0),
        {"tool": "upload", "args": {"local": "tree", "remote": "tree", "resume": True}},
        bash(cut, returncode=0),
        {"tool": "upload", "args": {"local": "tree", "remote": "tree"}},
        {"tool": "download", "args": {"remote": "tree", "local": "back"}},
    ]}])
    result = run("batch", str(batch), "-o", "results.jsonl", "--no-progress")
    assert result.exit_code == 0, result.output
    (record,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert record["ok"], record
    resumed, again = record["steps"][2], record["steps"][4]
    # small.txt kept; big.bin sent from byte 100,000 on: one file's rest
    assert resumed["success"] and f"(1 file, {len(big) - 100_000} bytes, 1 kept)" in resumed["output"], resumed
    assert again["success"] and f"(2 files, {len(big) + 6} bytes)" in again["output"], again
    assert (tmp_path / "back" / "big.bin").read_bytes() == big  # the host's verdict
    assert (tmp_path / "back" / "small.txt").read_text() == "small\n"


def test_a_transfer_steps_resume_must_be_true_or_false(tmp_path: Path) -> None:
    batch = write_jsonl(tmp_path / "bad.jsonl", [{"id": "t", "calls": [
        {"tool": "upload", "args": {"local": "a", "remote": "b", "resume": "yes"}}]}])
    result = run("batch", str(batch), "--no-progress")
    assert result.exit_code == 2 and "'resume' must be true or false" in result.output, result.output
