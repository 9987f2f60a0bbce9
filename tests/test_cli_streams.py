"""``hermes-modal-tool exec`` as a terminal user sees it: output live, stderr to stderr,
stdout byte-exact, the exit code passed through. The real command, in a subprocess."""

from __future__ import annotations

import hashlib
import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console
from rich.progress import BarColumn, TextColumn

from hermes_modal_tool import OutputEvent
from hermes_modal_tool.cli._live_progress import LiveLines, LiveProgress

CLI = Path(sys.executable).with_name("hermes-modal-tool")


@pytest.fixture
def env() -> Iterator[dict[str, str]]:
    """The CLI's environment, with a TMPDIR its slots can reach (not pytest's 0700 one)."""
    tmp = Path(tempfile.mkdtemp(prefix="hmt-cli-streams-"))
    tmp.chmod(0o711)
    yield {**os.environ, "TMPDIR": str(tmp)}
    shutil.rmtree(tmp, ignore_errors=True)


def test_stdout_and_stderr_apart_and_byte_exact(env: dict[str, str]) -> None:
    blob = bytes(range(256)) * 4 + b"\x00tail\xff"
    fmt = "".join(f"\\{b:03o}" for b in blob)
    proc = subprocess.run([str(CLI), "exec", f"printf '{fmt}'; printf 'E\\000\\376' >&2; exit 3"],
                          env=env, capture_output=True, timeout=120)
    assert proc.returncode == 3
    assert proc.stdout == blob
    assert proc.stderr == b"E\x00\xfe"


def test_stderr_can_be_thrown_away(env: dict[str, str]) -> None:
    proc = subprocess.run([str(CLI), "exec", "echo out; echo err >&2"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=120)
    assert proc.stdout == b"out\n" and proc.returncode == 0


def test_output_past_the_cap_is_shown_whole(env: dict[str, str]) -> None:
    """Live output is not capped (only the result kept for a model is): 1 MB comes through."""
    proc = subprocess.run([str(CLI), "exec", "head -c 1000000 /dev/urandom | tee /tmp/x | sha256sum >&2; "
                           "cat /tmp/x"], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout) == 1_000_000
    assert proc.stderr.split()[0].decode() == hashlib.sha256(proc.stdout).hexdigest()
    assert b"capped" not in proc.stderr


def test_output_is_shown_while_the_command_runs(env: dict[str, str]) -> None:
    proc = subprocess.Popen([str(CLI), "exec", "echo begin; sleep 5; echo end"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        sel = selectors.DefaultSelector()
        assert proc.stdout is not None
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=60), "no output within 60 s"
        first = os.read(proc.stdout.fileno(), 100)
        seen = time.monotonic()
        rest, _ = proc.communicate(timeout=60)
        ended = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert first == b"begin\n"
    assert rest == b"end\n"
    assert ended - seen > 4, "begin came only at the end"
    assert proc.returncode == 0


def test_batch_shows_each_trajectorys_output_as_it_runs(env: dict[str, str], tmp_path: Path) -> None:
    rows = [{"id": "slow-one", "calls": [{"tool": "bash", "args": {"command": "echo live-marker; sleep 4"}}]},
            {"id": "quick", "calls": [{"tool": "bash", "args": {"command": "true"}}]}]  # prints nothing
    batch = tmp_path / "b.jsonl"
    batch.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.Popen([str(CLI), "batch", str(batch), "--slots-per-sandbox", "2",
                             "--max-sandboxes", "1"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stderr is not None
        seen = b""
        deadline = time.monotonic() + 60
        while b"[slow-one] live-marker" not in seen and time.monotonic() < deadline:
            chunk = os.read(proc.stderr.fileno(), 4096)
            assert chunk, f"the batch ended without showing live output: {seen!r}"
            seen += chunk
        assert proc.poll() is None, "live-marker was shown only after the batch ended"
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert [json.loads(line)["ok"] for line in out.splitlines()] == [True, True]


def test_batch_on_a_terminal_draws_each_trajectorys_last_line_under_the_bar() -> None:
    console = Console(force_terminal=True, width=80, record=True)
    live = LiveLines(console, plain=False)
    bar = LiveProgress(TextColumn("calls"), BarColumn(), console=console, live=live, auto_refresh=False)
    bar.add_task("calls", total=2)
    with bar:
        live.watch("traj-1")(OutputEvent(0, "s1", "stdout", "building...\nstep 2 of 5\npart"))
        live.watch("traj-2")(OutputEvent(0, "s2", "stderr", "warning: x\n"))
        live.watch("traj-3")(OutputEvent(0, "s3", "stdout", "gone\n"))
        live.done("traj-3")
        bar.refresh()
    text = console.export_text()
    last = text[text.rindex("calls"):]
    assert "traj-1: step 2 of 5" in last and "traj-2: warning: x" in last and "traj-3" not in last
