"""benchmarks/host_calls.py at a tiny size: both responders (in-process, and processes over
real pipes with replies split and spread in time) answer every call, the benchmark checks
each round's last output, prints its figures and leaves no responder process behind; a
responder that answers the wrong output fails the run (the benchmark's own check)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import processes

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
SMALL = ["--sandboxes", "2", "--slots", "4", "--seconds", "0.3", "--runs", "1"]


def _responders() -> set[int]:
    """Pids of live responder processes (``support.processes``: zombies left out)."""
    return {p.pid for p in processes().values() if b"_responder.py" in p.cmdline}


def _run(bench: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(bench / "host_calls.py"), *SMALL, *extra],
                          capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("extra", [(), ("--pipes",), ("--pipes", "--parts", "2", "--spread-ms", "1")],
                         ids=["in-process", "pipes", "pipes-spread"])
def test_host_calls_runs_and_leaves_no_responder(extra):
    before = _responders()
    proc = _run(BENCH, *extra)
    output = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, output
    line = proc.stdout.splitlines()[0]
    calls_per_s = float(re.search(r"\(([\d,]+) calls/s", line).group(1).replace(",", ""))
    assert calls_per_s > 0, line
    if extra:
        sleeps = float(re.search(r"([\d.]+) sleeps per round", line).group(1))
        assert sleeps >= 0, line
        assert "responder processes over pipes" in line, line
    assert re.search(r"^HOST_CALLS_US \d+\.\d+$", proc.stdout, re.M), output
    assert _responders() <= before, "a responder process was left running"


def test_a_responder_with_the_wrong_output_fails_the_run(tmp_path):
    bench = tmp_path / "benchmarks"
    shutil.copytree(BENCH, bench, ignore=shutil.ignore_patterns("results", "__pycache__"))
    src = (bench / "_responder.py").read_text()
    assert '[5:] + "\\n"' in src
    (bench / "_responder.py").write_text(src.replace('[5:] + "\\n"', '[5:] + "x\\n"'))
    before = _responders()
    proc = _run(bench, "--pipes")
    assert proc.returncode != 0, proc.stdout
    assert "AssertionError" in proc.stderr, proc.stderr[-3000:]
    assert _responders() <= before, "the failed run left a responder process running"
