"""The command line, run the way a user runs it, on real local sandboxes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import bash, run, write_jsonl

from hermes_modal_tool import cli
from hermes_modal_tool.protocol import TOOLS

ROOT = Path(__file__).resolve().parent.parent


def test_batch_runs_each_trajectory_in_its_own_slot(tmp_path: Path) -> None:
    batch = write_jsonl(tmp_path / "batch.jsonl", [
        {"id": "persist", "calls": [bash("mkdir proj && cd proj && export GREETING=hi"),
                                    bash('echo "$PWD $GREETING"', output_contains="/proj hi")]},
        {"id": "files", "meta": {"task": "t1"}, "calls": [
            {"tool": "write_file", "args": {"path": "a/b.txt", "content": "hello\n"}},
            {"tool": "read_file", "args": {"path": "a/b.txt"}, "expect": {"output_contains": "hello"}},
            {"tool": "read_file", "args": {"path": "missing.txt"}, "expect": {"success": False}},
            bash("sh -c 'exit 3'", returncode=3)]},
        {"id": "slow", "calls": [{"tool": "bash", "args": {"command": "sleep 10", "timeout": 0.3},
                                  "expect": {"timed_out": True, "returncode": 124}},
                                 bash("echo still here", output_contains="still here")]},
    ])
    out = tmp_path / "results.jsonl"
    result = run("batch", str(batch), "-o", str(out), "--no-progress", "--slots-per-sandbox", "4")
    assert result.exit_code == 0, result.output
    assert "expectation mismatches" in result.output
    assert "3 (3 of them expected)" in result.output  # the missing file, exit 3, the timeout
    # Each rate says what it measures; the pool table's x/y columns say what x and y are.
    assert "calls per second (calls / run time)" in result.output
    assert "healthy/all" in result.output and "used/all" in result.output
    assert "(10 s)" in result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["persist", "files", "slow"]
    assert all(r["ok"] and r["error"] is None for r in records)
    assert len({r["slot_id"] for r in records}) == 3
    assert records[1]["meta"] == {"task": "t1"}
    missing = records[1]["steps"][2]
    assert missing["success"] is False and "missing.txt" in missing["error"]
    timed_out = records[2]["steps"][0]
    assert timed_out["timed_out"] is True and timed_out["returncode"] == 124
    assert set(timed_out) >= {"tool", "success", "returncode", "timed_out", "duration_s", "output",
                              "error", "expectation_met"}
    # What each trajectory used (usage ledger), and the sums in the summary.
    assert records[1]["usage"]["calls"] == {"write_file": 1, "read_file": 2, "bash": 1}
    assert records[2]["usage"]["wall_s"] >= 0.3 and records[0]["usage"]["slot_id"] == records[0]["slot_id"]
    assert "usage (sum over trajectories)" in result.output
    assert "not used by any trajectory" in result.output


def test_batch_unmet_expectation_exits_1_and_says_why(tmp_path: Path) -> None:
    # A call without "expect" expects success; `false` does not succeed.
    batch = write_jsonl(tmp_path / "b.jsonl", [{"id": "x", "calls": [bash("false"), bash("echo after")]}])
    result = run("batch", str(batch), "--no-progress")
    assert result.exit_code == 1
    record = json.loads(result.stdout.splitlines()[0])  # results go to stdout without -o
    assert record["ok"] is False
    assert record["steps"][0]["mismatches"] == ["success: expected true, got false"]
    assert record["steps"][1]["expectation_met"] is True


@pytest.mark.parametrize(("lines", "message"), [
    (['{"id": "a", "calls": []}', '{"id": "b", "calls": [}'], "line 2: invalid JSON"),
    (['{"calls": []}'], "line 1: missing 'id'"),
    (['{"id": "a"}'], "line 1 (id 'a'): missing 'calls'"),
    (['{"id": "a", "calls": [{"tool": "shell", "args": {"command": "ls"}}]}'], "line 1 (id 'a'): calls[0]: tool 'shell' is not one of"),
    (['{"id": "a", "calls": [{"tool": "bash", "args": {"cmd": "ls"}}]}'], "line 1 (id 'a'): calls[0]: bash has no argument 'cmd'"),
    (['{"id": "a", "calls": [{"tool": "write_file", "args": {"path": "x"}}]}'], "line 1 (id 'a'): calls[0]: missing required argument 'content' of write_file"),
    (['{"id": "a", "calls": [{"tool": "bash", "args": {"command": "ls"}, "expect": {"rc": 0}}]}'],
     "line 1 (id 'a'): calls[0]: expect has no key 'rc'"),
    (['{"id": "a", "calls": []}', "", '{"id": "a", "calls": []}'], "line 3 (id 'a'): id 'a' repeats line 1"),
    (['{"id": "a", "profile": "gpu", "calls": []}'], "line 1 (id 'a'): unknown profile 'gpu'"),
])
def test_batch_bad_input_exits_2_naming_the_line(tmp_path: Path, monkeypatch, lines, message) -> None:
    def no_sandboxes(*args, **kwargs):
        raise AssertionError("a sandbox backend was created for bad input")

    monkeypatch.setattr(cli.batch, "ToolBackend", no_sandboxes)
    batch = write_jsonl(tmp_path / "bad.jsonl", lines)
    result = run("batch", str(batch))
    assert result.exit_code == 2
    assert f"{batch}, {message}" in result.output


def test_exec_exits_with_the_commands_code() -> None:
    result = run("exec", "--", "sh", "-c", "echo out; exit 7")
    assert result.exit_code == 7
    assert result.stdout == "out\n"


def test_exec_shell_line_and_timeout() -> None:
    assert run("exec", "echo hi | tr a-z A-Z").stdout == "HI\n"
    result = run("exec", "--timeout", "0.3", "--", "sleep", "10")
    assert result.exit_code == 124
    assert "timed out" in result.stderr


def test_exec_shows_bashs_own_name_in_its_messages() -> None:
    """The file the slot's shell sources a command from is internal: its messages read as a
    terminal's (`bash: ...`), with the line only for commands of several lines."""
    result = run("exec", "--", "no-such-command")
    assert result.exit_code == 127
    assert result.output == "bash: no-such-command: command not found\n"
    result = run("exec", "echo one\nno-such-either")
    assert result.output == "one\nbash: line 2: no-such-either: command not found\n"
    assert "/run/hmt" not in result.output


def test_profiles_check(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("default_profile: small\nprofiles:\n  small:\n    driver: local\n    max_pool: 2\n"
                    "  big:\n    driver: local\n    slots_per_sandbox: 32\n")
    result = run("profiles", "check", str(good))
    assert result.exit_code == 0, result.output
    assert "small *" in result.output and "big" in result.output

    bad = tmp_path / "bad.yaml"
    bad.write_text("profiles:\n  default:\n    min_pool: 4\n    max_pool: 2\n")
    result = run("profiles", "check", str(bad))
    assert result.exit_code == 1
    assert str(bad) in result.stderr and "'default'" in result.stderr and "max_sandboxes" in result.stderr


def test_batch_bad_profiles_file_exits_2(tmp_path: Path) -> None:
    batch = write_jsonl(tmp_path / "b.jsonl", [{"id": "a", "calls": []}])
    bad = tmp_path / "p.yaml"
    bad.write_text("profiles:\n  default:\n    slotz: 3\n")
    result = run("batch", str(batch), "--profiles-file", str(bad))
    assert result.exit_code == 2
    assert "key 'slotz': unknown key" in result.output


def test_every_tool_has_an_argument_contract() -> None:
    assert sorted(cli.TOOL_ARGS) == sorted(TOOLS)


def test_committed_example_matches_its_generator(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_coding_rollouts",
                                                  ROOT / "examples" / "make_coding_rollouts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fresh = tmp_path / "rollouts.jsonl"
    assert module.main(["make", str(fresh)]) == 0
    committed = ROOT / "examples" / "coding_rollouts.jsonl"
    assert fresh.read_text() == committed.read_text()
    trajectories = cli.parse_batch(str(committed))
    assert len(trajectories) == 64
    assert len({t.id for t in trajectories}) == 64


def modal_gc(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``hermes-modal-tool modal gc --dry-run`` as its own process (the SDK reads its
    credentials once, at import)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}
    return subprocess.run([str(Path(sys.executable).with_name("hermes-modal-tool")), "modal", "gc",
                           "--dry-run"], env={**clean, **env}, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("config_file", ["missing", "no token"])
def test_modal_gc_without_credentials_says_what_it_read_and_how_to_log_in(tmp_path: Path,
                                                                           config_file: str) -> None:
    toml = tmp_path / "modal.toml"
    if config_file == "no token":
        toml.write_text("[default]\nenvironment = 'main'\n")
    result = modal_gc({"MODAL_CONFIG_PATH": str(toml)})
    assert result.returncode == 1
    err = result.stderr
    assert "no Modal credentials" in err and "MODAL_TOKEN_ID" in err and str(toml) in err, err
    assert ("no such file" if config_file == "missing" else "no token") in err, err
    assert "modal token new" in err, err
    assert "profile 'gc'" not in err and "Traceback" not in err, err


def test_modal_gc_with_rejected_credentials_says_so(modal_server) -> None:
    env = {**modal_server.env(), "MODAL_TOKEN_SECRET": "as-wrong"}
    result = modal_gc(env)
    assert result.returncode == 1
    err = result.stderr
    assert "rejected the credentials" in err and "MODAL_TOKEN_ID" in err, err
    assert "modal token new" in err and "profile 'gc'" not in err and "Traceback" not in err, err
