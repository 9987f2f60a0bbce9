"""The command line given bad input (click's CliRunner): bad JSONL batches, ``exec``
with nothing to run, ``profiles check`` with bad files. Bad input exits 2 (1 for
``profiles check``) with a message naming the file, the line and the bad value;
no traceback ever reaches the user.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hermes_modal_tool import cli


def run(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(cli.main, list(args), input=input, catch_exceptions=True)


def no_crash(r: Result) -> None:
    assert r.exception is None or isinstance(r.exception, SystemExit), (
        f"uncaught {type(r.exception).__name__}: {r.exception}\n{r.output}")
    assert "Traceback" not in r.output, r.output


def write(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines),
                    encoding="utf-8")
    return path


GOOD_CALL = {"tool": "bash", "args": {"command": "true"}}

#: (label, the one line of the batch file, words the message must contain)
BAD_LINES: list[tuple[str, Any, list[str]]] = [
    ("not-json", "{id: 1}", ["line 1", "invalid JSON"]),
    ("truncated", '{"id": "a", "calls": [', ["line 1", "invalid JSON"]),
    ("array", [1, 2], ["list"]),
    ("string", '"hello"', ["str"]),
    ("no-id", {"calls": []}, ["'id'"]),
    ("empty-id", {"id": "", "calls": []}, ["'id'", "''"]),
    ("int-id", {"id": 5, "calls": []}, ["'id'", "5"]),
    ("no-calls", {"id": "a"}, ["'calls'"]),
    ("calls-dict", {"id": "a", "calls": {}}, ["'calls'", "dict"]),
    ("unknown-key", {"id": "a", "calls": [], "cals": []}, ["'cals'"]),
    ("profile-int", {"id": "a", "calls": [], "profile": 3}, ["'profile'", "3"]),
    ("call-str", {"id": "a", "calls": ["ls"]}, ["calls[0]", "str"]),
    ("call-unknown-key", {"id": "a", "calls": [{**GOOD_CALL, "tol": 1}]}, ["calls[0]", "'tol'"]),
    ("tool-unknown", {"id": "a", "calls": [{"tool": "sh", "args": {}}]}, ["calls[0]", "'sh'"]),
    ("tool-missing", {"id": "a", "calls": [{"args": {"command": "x"}}]}, ["calls[0]", "None"]),
    ("args-list", {"id": "a", "calls": [{"tool": "bash", "args": ["ls"]}]}, ["calls[0]", "'args'", "list"]),
    ("arg-unknown", {"id": "a", "calls": [{"tool": "bash", "args": {"command": "x", "cmd": 1}}]},
     ["calls[0]", "'cmd'"]),
    ("arg-missing", {"id": "a", "calls": [{"tool": "write_file", "args": {"path": "x"}}]},
     ["calls[0]", "'content'"]),
    ("command-int", {"id": "a", "calls": [{"tool": "bash", "args": {"command": 5}}]},
     ["calls[0]", "'command'", "5"]),
    ("timeout-neg", {"id": "a", "calls": [{"tool": "bash", "args": {"command": "x", "timeout": -1}}]},
     ["calls[0]", "'timeout'", "-1"]),
    ("timeout-str", {"id": "a", "calls": [{"tool": "bash", "args": {"command": "x", "timeout": "5"}}]},
     ["'timeout'", "'5'"]),
    ("timeout-nan", '{"id": "a", "calls": [{"tool": "bash", "args": {"command": "x", "timeout": NaN}}]}',
     ["'timeout'", "nan"]),
    ("timeout-inf", '{"id": "a", "calls": [{"tool": "bash", "args": {"command": "x", "timeout": Infinity}}]}',
     ["'timeout'", "inf"]),
    ("timeout-huge-int", '{"id": "a", "calls": [{"tool": "bash", "args": {"command": "x", "timeout": 1'
     + "0" * 400 + '}}]}', ["'timeout'"]),
    ("timeout-over-max", {"id": "a", "calls": [{"tool": "bash", "args": {"command": "x", "timeout": 10**6}}]},
     ["'timeout'"]),
    ("env-names", {"id": "a", "calls": [{"tool": "bash", "args": {"command": "x", "env": {"1A": "x"}}}]},
     ["'env'", "1A"]),
    ("recursive-str", {"id": "a", "calls": [{"tool": "list_files", "args": {"recursive": "no"}}]},
     ["'recursive'", "'no'"]),
    ("encoding", {"id": "a", "calls": [{"tool": "read_file", "args": {"path": "x", "encoding": "utf8"}}]},
     ["'encoding'", "utf8"]),
    ("expect-unknown", {"id": "a", "calls": [{**GOOD_CALL, "expect": {"rc": 0}}]}, ["'rc'"]),
    ("expect-type", {"id": "a", "calls": [{**GOOD_CALL, "expect": {"returncode": "0"}}]},
     ["'returncode'", "'0'"]),
    ("path-nul", {"id": "a", "calls": [{"tool": "read_file", "args": {"path": "a\u0000b"}}]},
     ["'path'", "NUL"]),
    ("command-nul", {"id": "a", "calls": [{"tool": "bash", "args": {"command": "a\u0000b"}}]},
     ["'command'", "NUL"]),
]


@pytest.mark.parametrize(("label", "line", "words"), BAD_LINES, ids=[b[0] for b in BAD_LINES])
def test_bad_batch_line_exits_2_naming_file_line_and_value(tmp_path: Path, label: str, line: Any,
                                                           words: list[str]) -> None:
    path = write(tmp_path / "b.jsonl", [{"id": "ok", "calls": [GOOD_CALL]}, line])
    r = run("batch", str(path), "--no-progress", "--slots-per-sandbox", "2", "--max-sandboxes", "1")
    no_crash(r)
    assert r.exit_code == 2, f"{label}: exit {r.exit_code}, expected 2 (bad input)\n{r.output[-600:]}"
    assert str(path) in r.output and "line 2" in r.output, r.output
    for w in words:
        assert w in r.output, f"{label}: {w!r} not in {r.output!r}"


@pytest.mark.parametrize(("label", "content"), [
    ("empty", b""), ("blank-lines", b"\n\n  \n"), ("non-utf8", b'{"id": "\xff"}\n'), ("bom", b"\xef\xbb\xbf{}\n")])
def test_batch_files_without_trajectories_or_text(tmp_path: Path, label: str, content: bytes) -> None:
    path = tmp_path / "b.jsonl"
    path.write_bytes(content)
    r = run("batch", str(path), "--no-progress")
    no_crash(r)
    assert r.exit_code == 2 and str(path) in r.output, (label, r.exit_code, r.output)


def test_duplicate_ids_name_both_lines(tmp_path: Path) -> None:
    path = write(tmp_path / "b.jsonl", [{"id": "a", "calls": []}, {"id": "a", "calls": []}])
    r = run("batch", str(path), "--no-progress")
    assert r.exit_code == 2 and "line 2" in r.output and "repeats line 1" in r.output, r.output


@pytest.mark.parametrize("args", [
    ["batch"], ["batch", "/nonexistent/b.jsonl"], ["batch", "."],
    ["batch", "{f}", "--timeout", "0"], ["batch", "{f}", "--timeout", "-1"], ["batch", "{f}", "--timeout", "x"],
    ["batch", "{f}", "--slots-per-sandbox", "0"], ["batch", "{f}", "--max-sandboxes", "-2"],
    ["batch", "{f}", "--profile", "gpu"], ["batch", "{f}", "--profiles-file", "/nonexistent.yaml"],
    ["batch", "{f}", "-o", "/nonexistent-dir/out.jsonl"],
    ["exec"], ["exec", "--timeout", "0", "true"], ["exec", "--timeout", "nan", "true"],
    ["exec", "--profile", "nope", "true"], ["exec", "--profiles-file", "/nonexistent.yaml", "true"],
    ["profiles", "check"], ["profiles", "check", "/nonexistent.yaml"], ["nope"],
])
def test_bad_command_lines_exit_nonzero_with_a_message(tmp_path: Path, args: list[str]) -> None:
    f = write(tmp_path / "b.jsonl", [{"id": "a", "calls": [GOOD_CALL]}])
    r = run(*[a.replace("{f}", str(f)) for a in args])
    no_crash(r)
    assert r.exit_code != 0, (args, r.output)
    assert r.output.strip(), args
    bad = [a for a in args[1:] if a not in ("check",) and not a.startswith("-") and a != "{f}"]
    if bad:
        assert any(b in r.output for b in bad), f"{args}: the message does not name the bad value: {r.output}"


def test_exec_with_an_empty_command_string(tmp_path: Path) -> None:
    r = run("exec", "")
    no_crash(r)
    assert r.exit_code in (0, 2), r.output


@pytest.mark.parametrize(("text", "words"), [
    ("", ["empty"]),
    ("profiles:\n  default:\n    cpus: 2\n", ["'default'", "'cpus'"]),
    ("profiles:\n  default:\n    memory: lots\n", ["'memory'", "lots"]),
    ("profiles: [", ["not valid YAML"]),
    ("- 1\n", ["mapping"]),
])
def test_profiles_check_bad_file_exits_1_naming_file_and_key(tmp_path: Path, text: str,
                                                             words: list[str]) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    r = run("profiles", "check", str(path))
    no_crash(r)
    assert r.exit_code == 1 and "invalid" in r.output and str(path) in r.output, r.output
    for w in words:
        assert w in r.output, r.output


def test_profiles_check_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(b"profiles:\n  default:\n    image: \xff\n")
    r = run("profiles", "check", str(path))
    no_crash(r)
    assert r.exit_code == 1 and str(path) in r.output, r.output


@settings(max_examples=50, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(line=st.text(max_size=60) | st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["id", "calls", "tool", "args", "command", "expect", "profile", "x"]), inner, max_size=4),
    max_leaves=8).map(json.dumps))
def test_random_batch_lines_never_crash(tmp_path: Path, line: str) -> None:
    """Random lines: exit 2 with the file named, never a traceback. (Lines that happen to
    be valid would start sandboxes: they are skipped by parsing first.)"""
    path = tmp_path / "r.jsonl"
    path.write_text(line + "\n", encoding="utf-8", errors="surrogatepass")
    try:
        cli.parse_batch(str(path))
    except cli.InputError as exc:
        assert str(path) in exc.message, exc.message
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(f"parse_batch raised {type(exc).__name__}: {exc} for {line!r}") from exc


def test_a_valid_line_with_a_line_separator_inside_a_string(tmp_path: Path) -> None:
    """JSON strings may hold U+2028 / U+0085 raw; such a line is one line of JSONL."""
    path = tmp_path / "b.jsonl"
    path.write_text(json.dumps({"id": "a\u2028b\u0085c", "calls": [GOOD_CALL]}, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    [t] = cli.parse_batch(str(path))
    assert t.id == "a\u2028b\u0085c"
