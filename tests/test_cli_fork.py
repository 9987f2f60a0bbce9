"""The batch file's ``setup`` and ``fork``, run the way a user runs them, and the GRPO example."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import bash, run, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="forks need a layered root (run as root)")


SETUP = ["mkdir -p /workspace/p && cd /workspace/p && echo $RANDOM$RANDOM > seed && export MODE=ready"]


@pytest.mark.parametrize("no_fork", [False, True])
def test_setup_and_fork_in_a_batch_file(tmp_path: Path, no_fork: bool) -> None:
    rows = [{"id": f"r{i}", "setup": SETUP, "calls": [bash("pwd; echo $MODE; cat seed", output_contains="ready")]}
            for i in range(4)]
    rows.append({"id": "base", "calls": [bash("mkdir -p /srv/b && cd /srv/b && echo one > f && export X=1")]})
    rows += [{"id": f"child{i}", "fork": "base", "calls": [bash("echo $X; cat f; pwd", output_contains="1\none\n/srv/b")]}
             for i in range(3)]
    batch = write_jsonl(tmp_path / "b.jsonl", rows)
    out = tmp_path / "out.jsonl"
    args = [str(batch), "-o", str(out), "--no-progress", "--slots-per-sandbox", "8", "--max-sandboxes", "1"]
    result = run("batch", *args, *(["--no-fork"] if no_fork else []))
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["ok"] for r in records), records
    seeds = {r["steps"][0]["output"].split()[-1] for r in records if r["id"].startswith("r")}
    # with forks the setup ran once (one seed); without, once per trajectory
    assert len(seeds) == (4 if no_fork else 1)
    assert all("setup_s" in r and "rollout_s" in r for r in records)


def test_fork_of_an_unknown_or_cyclic_trajectory_is_refused(tmp_path: Path) -> None:
    batch = write_jsonl(tmp_path / "b.jsonl", [{"id": "a", "fork": "zz", "calls": []}])
    result = run("batch", str(batch))
    assert result.exit_code == 2 and "'fork' names 'zz'" in result.output
    batch = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "fork": "b", "calls": []},
                                               {"id": "b", "fork": "a", "calls": []}])
    result = run("batch", str(batch))
    assert result.exit_code == 2 and "cycle" in result.output


def test_failed_source_fails_its_forks(tmp_path: Path) -> None:
    batch = write_jsonl(tmp_path / "b.jsonl", [
        {"id": "src", "setup": ["exit 5"], "calls": [bash("true")]},
        {"id": "kid", "fork": "src", "calls": [bash("true")]},
        {"id": "bad-setup", "setup": ["echo nope; exit 4"], "calls": [bash("true")]}])
    out = tmp_path / "out.jsonl"
    result = run("batch", str(batch), "-o", str(out), "--no-progress", "--slots-per-sandbox", "4",
                 "--max-sandboxes", "1")
    assert result.exit_code == 1
    rec = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "'src', which it forks from, failed" in rec["kid"]["error"]
    assert rec["kid"]["slot_id"] is None
    assert "setup failed" in rec["bad-setup"]["error"] and "nope" in rec["bad-setup"]["error"]


@pytest.mark.timeout(660)  # the example's own limit is 600 s (no-fork mode: ~300 s on a loaded 2-core machine)
def test_grpo_example_runs_and_compares() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "grpo_group.py"), "--slots", "36"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "total, forks:" in proc.stdout and "total, no fork:" in proc.stdout
    # The table: one row per task and mode, "solved" out of 8 rollouts. Each task has a
    # right fix among its 8 candidates and wrong ones, so a grade that works solves some but
    # not all; forks (from the task's set-up snapshot) solve exactly what fresh slots solve.
    rows = re.findall(r"^(\S+)\s+(forks|no fork)\s+[\d.]+\s+[\d.]+\s+(\d+)/8$", proc.stdout, re.M)
    assert len(rows) == 8, proc.stdout  # 4 tasks x 2 modes
    solved: dict[str, dict[str, int]] = {}
    for task, mode, n in rows:
        solved.setdefault(task, {})[mode] = int(n)
    assert len(solved) == 4, solved
    for task, by_mode in solved.items():
        assert 0 < by_mode["forks"] < 8, (task, by_mode, proc.stdout)
        assert by_mode["forks"] == by_mode["no fork"], (task, by_mode)
