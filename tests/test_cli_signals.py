"""``exec`` and ``batch`` end cleanly on SIGTERM and SIGHUP, as on Ctrl-C (SIGINT).

Each case starts the real ``hermes-modal-tool`` command as its own process with its
own ``TMPDIR``, sends the signal while a command runs in a slot, then checks on the
file system and in ``/proc``: the command exits with 128 + the signal's number and
says it stopped its sandboxes; no state directory is left in that ``TMPDIR`` or in
``/dev/shm`` (the control directory every slot's bwrap names); no process it
started (agent, bwrap, slot shell, ``sleep``) is still alive.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import SHM_DIR, describe, processes

CLI = Path(sys.executable).with_name("hermes-modal-tool")
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGHUP": signal.SIGHUP, "SIGINT": signal.SIGINT}


def descendants(root: int) -> dict[int, bytes]:
    """pid -> command line of every live process below ``root``."""
    procs = processes()
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out[child] = procs[child].cmdline
            todo.append(child)
    return out


def start(args: list[str], tmp: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "TMPDIR": str(tmp)}
    # A background job may inherit SIGINT ignored; give the CLI the default, as a terminal would.
    return subprocess.Popen([str(CLI), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_sleep(proc: subprocess.Popen[str], n: int, timeout: float = 60) -> dict[int, bytes]:
    """The CLI's descendants once ``n`` slot commands (``sleep 120``) run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the CLI ended early: {proc.communicate()}"
        below = descendants(proc.pid)
        if sum(cmd == b"sleep\x00120\x00" for cmd in below.values()) >= n:
            return below
        time.sleep(0.1)
    raise AssertionError(f"no {n} running 'sleep 120' below the CLI after {timeout} s: {below}")


@pytest.fixture
def own_tmp() -> Iterator[Path]:
    """An empty TMPDIR for the CLI, in the system temp dir (slots run as their own uids:
    they must be able to reach their workspaces in it, which pytest's 0700 tmp_path forbids)."""
    tmp = Path(tempfile.mkdtemp(prefix="hmt-signal-"))
    tmp.chmod(0o711)
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("name", list(SIGNALS))
@pytest.mark.parametrize("command", ["exec", "batch"])
def test_a_signal_stops_every_sandbox_and_leaves_nothing(command: str, name: str, tmp_path: Path,
                                                         own_tmp: Path) -> None:
    if command == "exec":
        args, running = ["exec", "--", "sleep 120"], 1
    else:
        batch = tmp_path / "batch.jsonl"
        batch.write_text("".join(json.dumps({"id": f"t{i}", "calls": [
            {"tool": "bash", "args": {"command": "sleep 120", "timeout": 300}}]}) + "\n"
            for i in range(3)))
        args, running = ["batch", str(batch), "-o", str(tmp_path / "out.jsonl"), "--no-progress",
                         "--slots-per-sandbox", "2"], 3
    proc = start(args, own_tmp)
    try:
        below = wait_for_sleep(proc, running)
        shm_dirs = {m.decode() for cmd in below.values() for m in SHM_DIR.findall(cmd)}
        assert shm_dirs, "the slots' bwrap command lines name no /dev/shm control directory"
        assert [p.name for p in own_tmp.iterdir()], "the local driver made no state dir in TMPDIR"
        started = time.monotonic()
        proc.send_signal(SIGNALS[name])
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert time.monotonic() - started < 30, "stopping took longer than 30 s"
    sig = SIGNALS[name]
    assert proc.returncode == 128 + sig, (proc.returncode, out, err)
    said = out + err
    if sig == signal.SIGINT:
        assert "interrupted" in said or command == "exec", said
    else:
        assert f"stopped by {name}" in said, said
    assert list(own_tmp.iterdir()) == [], f"left in TMPDIR: {sorted(os.listdir(own_tmp))}"
    assert not [d for d in shm_dirs if os.path.exists(d)], f"left in /dev/shm: {shm_dirs}"
    alive = processes()
    left = [alive[pid] for pid, cmd in below.items() if pid in alive and alive[pid].cmdline == cmd]
    assert not left, f"processes left behind: {describe(left)}"
