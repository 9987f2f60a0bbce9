"""The main job (``bash scripts/main.sh``: examples/coding_rollouts.jsonl under ``--strict``).

Its expectations must be able to fail: a failed ``cd`` whose error message holds the
expected text, or a test run that runs no test, once met them (the ``cd_export``
rollouts' ``cd ~/proj`` failed since ``$HOME`` is the slot's ``/root``; the last step then
ran 0 tests, ``OK`` on Python 3.11 and exit 5 on 3.12).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_helpers import bash, run, write_jsonl

from hermes_modal_tool import cli
from hermes_modal_tool.cli._expect import check_expectations, reported_test_count, strict_problems

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "coding_rollouts.jsonl"


def _result(output: str, returncode: int) -> SimpleNamespace:
    return SimpleNamespace(output=output, returncode=returncode, success=returncode == 0, metadata={})


def test_an_error_message_never_meets_an_output_expectation() -> None:
    failed_cd = _result("bash: cd: /root/proj: No such file or directory\n", 1)
    assert check_expectations({"output_contains": "/proj"}, failed_cd) == ["success: expected true, got false"]
    worked = _result("/data/slot_3/proj\n", 0)
    assert check_expectations({"output_contains": "/proj"}, worked) == []  # positive control


def test_a_run_of_no_tests_never_meets_tests_ran() -> None:
    py311 = _result("\n----------------------------------------------------------------------\n"
                    "Ran 0 tests in 0.000s\n\nOK\n", 0)
    assert check_expectations({"returncode": 0, "output_contains": "OK"}, py311) == []  # the old check
    assert check_expectations({"returncode": 0, "tests_ran": 3}, py311) == ["tests_ran: expected 3, got 0"]
    py312 = _result("Ran 0 tests in 0.000s\n\nNO TESTS RAN\n", 5)
    assert len(check_expectations({"returncode": 0, "tests_ran": 3}, py312)) == 2
    assert check_expectations({"returncode": 0, "tests_ran": 3},
                              _result("Ran 3 tests in 0.001s\n\nOK\n", 0)) == []
    assert reported_test_count("===== 2 passed, 1 failed in 0.12s =====") == 3
    assert reported_test_count("no summary here") is None


def test_strict_refuses_loose_expectations_and_the_example_passes_it() -> None:
    loose = [SimpleNamespace(tool="bash", args={"command": "cd ~/proj && pwd"},
                             expect={"output_contains": "/proj"}),
             SimpleNamespace(tool="bash", args={"command": "python3 -m unittest -q"},
                             expect={"returncode": 0, "output_contains": "OK"})]
    problems = strict_problems((f"calls[{i}]", c) for i, c in enumerate(loose))
    assert problems == ["calls[0]: an expectation on the output must also give 'returncode'",
                        "calls[1]: a call that runs tests must give 'tests_ran' (how many must run)"]
    trajectories = cli.parse_batch(str(EXAMPLE))
    assert strict_problems((t.id, c) for t in trajectories for c in t.calls) == []
    assert "--strict" in (ROOT / "scripts" / "main.sh").read_text()


@pytest.mark.parametrize("host_processes", ["1", "2"])
def test_the_main_job_under_strict_expectations(tmp_path: Path, host_processes: str) -> None:
    """The main job, in one host process and spread over two (``--host-processes``)."""
    out = tmp_path / "results.jsonl"
    result = run("batch", str(EXAMPLE), "--strict", "-o", str(out), "--no-progress",
                 "--host-processes", host_processes)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 64 and all(r["ok"] for r in records), [r["id"] for r in records if not r["ok"]]
    # Sandbox ids carry their host process ("default-h1.0"), with more than one.
    hosts = {r["slot_id"].rsplit("-", 1)[-1].split(".")[0] for r in records if "." in r["slot_id"]}
    assert hosts == ({"h0", "h1"} if host_processes == "2" else set()), hosts
    cd_export = next(r for r in records if r["id"] == "fizzbuzz-cd_export")
    assert any(s["output"].strip().endswith("/proj") and s["returncode"] == 0 for s in cd_export["steps"])


def _rows() -> dict[str, dict]:
    return {row["id"]: row for row in map(json.loads, EXAMPLE.read_text().splitlines())}


def test_broken_rollouts_no_longer_pass(tmp_path: Path) -> None:
    rows = _rows()
    # The fix is never written: the rollout goes up a directory instead (0 tests run there).
    no_fix = copy.deepcopy(rows["fizzbuzz-plain"])
    no_fix["id"] = "no-fix"
    at = next(i for i, c in enumerate(no_fix["calls"]) if c["tool"] == "write_file" and i > 1)
    no_fix["calls"][at] = bash("cd ..", returncode=0)
    # The old cd_export step: `cd ~/proj` fails (HOME is /root), its error holds "/proj".
    old_cd = copy.deepcopy(rows["palindrome-cd_export"])
    old_cd["id"] = "old-cd"
    step = next(i for i, c in enumerate(old_cd["calls"]) if '"$PROJ"' in c["args"].get("command", ""))
    old_cd["calls"][step] = bash("cd ~/proj && pwd", output_contains="/proj")
    control = rows["roman-plain"]
    out = tmp_path / "r.jsonl"
    result = run("batch", str(write_jsonl(tmp_path / "b.jsonl", [no_fix, old_cd, control])),
                 "-o", str(out), "--no-progress")
    assert result.exit_code == 1
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for r in records.values():
        r["mismatches"] = [m for step in r["steps"] for m in step.get("mismatches", [])]
    assert records["roman-plain"]["ok"] is True  # positive control: the unbroken rollout passes
    assert records["no-fix"]["ok"] is False
    assert any("tests_ran: expected 3, got 0" in m for m in records["no-fix"]["mismatches"]), records["no-fix"]
    assert records["old-cd"]["ok"] is False
    assert any(m.startswith("success:") for m in records["old-cd"]["mismatches"]), records["old-cd"]
