"""Every tool argument of protocol.TOOL_ARGS given wrong values, through the engine.

Each bad argument must come back as a failed ExecutionResult whose error names the
argument and the bad value; nothing raises out of ``execute_batch``; the slot's
shell state (cwd, an exported variable) and its files survive every bad call.
One backend (on the portal loop) and one prepared slot serve the whole module.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from input_support import (
    assert_state_intact,
    batch,
    failed_naming,
    one,
    portal_backend,
    prepare_state,
    sh,
)
from support import layered

from hermes_modal_tool import ExecutionResult, Slot, ToolBackend
from hermes_modal_tool.portal import run_sync
from hermes_modal_tool.protocol import TOOL_ARGS, TOOLS

#: A valid call of each tool (paths exist after prepare_state).
VALID: dict[str, dict[str, Any]] = {
    "bash": {"command": "true"},
    "read_file": {"path": "keep/treasure.txt"},
    "write_file": {"path": "scratch/w.txt", "content": "x"},
    "list_files": {"path": "keep"},
    "read_artifact": {"path": "keep/treasure.txt"},
    "list_artifacts": {"path": "keep"},
    "archive_artifacts": {"path": "keep"},
}
#: Smallest accepted value of each int argument.
INT_MIN = {"offset": 0, "byte_offset": 0}

#: Wrong values per argument kind (a None means "not given" and is left out).
BAD_BY_KIND: dict[str, list[Any]] = {
    "str": [5, 1.5, True, False, 0, [], ["a"], {}, {"a": "b"}],
    "number": ["5", "", True, False, [], {}, -1, 0, -0.0, math.nan, math.inf, -math.inf, 1e300, 10**400],
    "int": ["5", "", 1.5, True, False, [], {}, -1, -(10**30)],
    "cells": ["24", 1.5, True, [], 0, -1, 65536, 10**20],
    "bool": ["yes", "false", "", 1, 0, 2, [], {}, [True]],
    "encoding": ["utf8", "TEXT", "hex", 5, 0, True, [], {}, ["text"]],
    "output_encoding": ["utf8", "base64", "BYTES", 5, True, [], {}, ["bytes"]],
    "env": ["A=1", "", [], ["A=1"], 5, True, {"1A": "x"}, {"": "x"}, {"A B": "x"}, {"A": 5},
            {"A": None}, {"A": "x\x00y"}, {"A": ["x"]}],
}


def _valid(kind: str, key: str, value: Any) -> bool:
    """Whether ``value`` is a good value of an argument of ``kind``."""
    if value is None:
        return True
    if kind == "str":
        return isinstance(value, str)
    if kind == "number":
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and 0 < value <= 86400)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool) and value >= INT_MIN.get(key, 1)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "cells":
        return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536
    if kind == "encoding":
        return value in ("text", "base64")
    if kind == "output_encoding":
        return value in ("text", "bytes")
    if kind == "env":
        return isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, str) and k.isidentifier() and k.isascii()
            and "\x00" not in v for k, v in value.items())
    raise AssertionError(kind)


def _names_value(error: str, value: Any) -> bool:
    """The error shows the bad value (its repr, or at least its type)."""
    shown = repr(value)
    return shown[:30] in error or type(value).__name__ in error or str(value)[:30] in error


CASES = [(tool, key, kind, value)
         for tool in TOOLS for key, (kind, _required) in TOOL_ARGS[tool].items()
         for value in BAD_BY_KIND[kind] if not _valid(kind, key, value)]


@pytest.fixture(scope="module")
def backend() -> Iterator[ToolBackend]:
    with portal_backend(slots_per_sandbox=4, max_sandboxes=1) as b:
        yield b


@pytest.fixture(scope="module")
def held(backend: ToolBackend) -> Slot:
    """A slot with a cwd, an exported variable and a file (checked after each test)."""
    slot = run_sync(backend.acquire("input-held"))
    prepare_state(backend, slot)
    return slot


@pytest.fixture(autouse=True)
def _state_survives(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "held" in request.fixturenames:
        b, s = request.getfixturevalue("backend"), request.getfixturevalue("held")
        assert_state_intact(b, s)


def check_bad(result: ExecutionResult, key: str, value: Any) -> None:
    assert isinstance(result, ExecutionResult)
    failed_naming(result, key)
    assert _names_value(result.error, value), (
        f"the error for {key}={value!r:.60} does not show the bad value: {result.error!r}")


# -- table: every argument, every kind of wrong value -------------------------------------

@pytest.mark.parametrize(("tool", "key", "kind", "value"), CASES,
                         ids=[f"{t}-{k}-{v!r:.20}" for t, k, _, v in CASES])
def test_wrong_value_is_a_failed_result_naming_arg_and_value(
        backend: ToolBackend, held: Slot, tool: str, key: str, kind: str, value: Any) -> None:
    args = {**VALID[tool], key: value}
    result = one(backend, held, tool, args)
    check_bad(result, key, value)


# -- hypothesis: random JSON values for each argument --------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.sampled_from([10**20, -(10**20), 10**400])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)

ARG_LIST = [(tool, key, kind) for tool in TOOLS for key, (kind, _r) in TOOL_ARGS[tool].items()]


RAW_PYTHON_ERRORS = ("TypeError", "ValueError:", "OverflowError", "AttributeError", "KeyError",
                     "IndexError", "RecursionError", "UnicodeEncodeError", "Traceback")


def _random_prop(backend: ToolBackend, held: Slot, tool: str, key: str, kind: str,
                 by_name: bool) -> None:
    @settings(max_examples=25, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(value=json_values)
    @example(value=10**400)
    @example(value=-(10**20))
    @example(value=math.nan)
    @example(value=-math.inf)
    @example(value=[[], {}])
    def prop(value: Any) -> None:
        if key in ("path", "command") and isinstance(value, str):
            return  # strings are good values here (paths are probed below)
        try:
            result = one(backend, held, tool, {**VALID[tool], key: value})
        except Exception as exc:  # noqa: BLE001 - nothing may raise out of a batch
            raise AssertionError(f"execute_batch raised {type(exc).__name__}: {exc}") from exc
        assert isinstance(result, ExecutionResult)
        if not result.success:
            assert result.error, result
            assert not any(w in result.error for w in RAW_PYTHON_ERRORS), (
                f"{tool} {key}={value!r:.60}: a raw Python error reached the caller: {result.error!r}")
        if by_name and not _valid(kind, key, value):
            check_bad(result, key, value)

    prop()


@pytest.mark.parametrize(("tool", "key", "kind"), ARG_LIST, ids=[f"{t}-{k}" for t, k, _ in ARG_LIST])
def test_random_json_values_never_crash(backend: ToolBackend, held: Slot, tool: str, key: str,
                                        kind: str) -> None:
    """Any JSON value for any argument: an ExecutionResult, never an exception or a raw
    Python error message (success is allowed: this property is about crashes)."""
    _random_prop(backend, held, tool, key, kind, by_name=False)


@pytest.mark.parametrize(("tool", "key", "kind"), ARG_LIST, ids=[f"{t}-{k}" for t, k, _ in ARG_LIST])
def test_random_wrong_values_are_refused_by_name(backend: ToolBackend, held: Slot, tool: str, key: str,
                                                 kind: str) -> None:
    """Any JSON value of the wrong kind: a failed result naming the argument and the value."""
    _random_prop(backend, held, tool, key, kind, by_name=True)


@settings(max_examples=50, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.text(max_size=40))
def test_random_paths_succeed_or_fail_naming_the_path(backend: ToolBackend, held: Slot, path: str) -> None:
    for tool in ("read_file", "list_files", "read_artifact"):
        r = one(backend, held, tool, {"path": path})
        assert isinstance(r, ExecutionResult)
        if not r.success:
            parts = [p for p in path.split("/") if p not in ("", ".")]
            assert r.error and not r.error.startswith(RAW_PYTHON_ERRORS + ("OSError",)), (tool, path, r.error)
            assert "path" in r.error or any(p in r.error for p in parts) or (
                not parts and "/" in r.error), (tool, path, r.error)


# -- missing and unknown arguments, unknown tools ------------------------------------------

REQUIRED = [(tool, key) for tool in TOOLS for key, (_k, req) in TOOL_ARGS[tool].items() if req]


@pytest.mark.parametrize(("tool", "key"), REQUIRED)
def test_missing_required_argument_is_named(backend: ToolBackend, held: Slot, tool: str, key: str) -> None:
    args = {k: v for k, v in VALID[tool].items() if k != key}
    failed_naming(one(backend, held, tool, args), key)


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("bogus", ["bogus", "", "Command", "1", "timeout_s"])
def test_unknown_argument_is_named_with_the_known_ones(backend: ToolBackend, held: Slot, tool: str,
                                                       bogus: str) -> None:
    if bogus in TOOL_ARGS[tool]:
        pytest.skip("a real argument of this tool")
    r = one(backend, held, tool, {**VALID[tool], bogus: 1})
    failed_naming(r, repr(bogus), tool, *TOOL_ARGS[tool])


@pytest.mark.parametrize("tool", ["bsh", "", "BASH", "bash ", "exec", "__init__", "read_file\x00"])
def test_unknown_tool_is_named_with_the_known_ones(backend: ToolBackend, held: Slot, tool: str) -> None:
    r = one(backend, held, tool, {"command": "true"})
    failed_naming(r, repr(tool), *TOOLS)


def test_args_that_are_not_json_are_a_failed_result_not_an_exception(backend: ToolBackend,
                                                                       held: Slot) -> None:
    """Values JSON cannot carry (bytes, sets, objects, tuple keys): a failed result for
    that request only; the rest of the batch runs."""
    bad_args = [{"command": b"echo hi"}, {"command": "true", "env": {"A": {1, 2}}},
                {"command": "true", "stdin": object()}, {("command",): "true"}]
    for args in bad_args:
        try:
            results = batch(backend, [(held, "bash", {"command": "echo before"}),
                                      (held, "bash", args),
                                      (held, "bash", {"command": "echo after"})])
        except Exception as exc:  # noqa: BLE001 - the point is that nothing raises
            pytest.fail(f"execute_batch raised {type(exc).__name__}: {exc} for args {args!r}")
        assert [r.output for r in (results[0], results[2])] == ["before\n", "after\n"], results
        assert not results[1].success and results[1].error, results[1]


# -- bash: timeouts, empty and enormous commands, NULs -------------------------------------

@pytest.mark.parametrize("timeout", [0, -1, -0.001, math.nan, math.inf, -math.inf, 1e300, 86400.5, 10**400])
def test_bad_bash_timeout_is_named(backend: ToolBackend, held: Slot, timeout: float) -> None:
    r = sh(backend, held, "echo should-not-run", timeout=timeout)
    failed_naming(r, "timeout")
    assert "should-not-run" not in r.output


@pytest.mark.parametrize("timeout_s", [0, -1, math.nan, -math.inf, "5", True, [5]])
def test_bad_batch_timeout_s_raises_usage_error_naming_it(backend: ToolBackend, held: Slot,
                                                          timeout_s: Any) -> None:
    from hermes_modal_tool import UsageError

    with pytest.raises(UsageError, match="timeout_s") as info:
        batch(backend, [(held, "bash", {"command": "true"})], timeout_s=timeout_s)
    assert repr(timeout_s)[:10] in str(info.value)


@pytest.mark.parametrize("timeout_s", [math.inf, 1e300, 86401])
def test_huge_batch_timeout_s_fails_each_request_naming_the_timeout(backend: ToolBackend, held: Slot,
                                                                    timeout_s: float) -> None:
    results = batch(backend, [(held, "bash", {"command": "echo x"})] * 2, timeout_s=timeout_s)
    for r in results:
        failed_naming(r, "timeout")


@pytest.mark.parametrize("command", ["", " ", "\n\n", "\t;", "#only a comment", ";", "(", "'", "\\"])
def test_empty_or_broken_commands_keep_the_shell(backend: ToolBackend, held: Slot, command: str) -> None:
    r = sh(backend, held, command)
    assert isinstance(r, ExecutionResult)
    if not r.success:
        assert r.metadata["returncode"] not in (None, 0) or r.error


def test_command_with_nul_is_refused_naming_the_nul(backend: ToolBackend, held: Slot) -> None:
    failed_naming(sh(backend, held, "echo a\x00b"), "NUL")


def test_five_megabyte_command_runs(backend: ToolBackend, held: Slot) -> None:
    command = ": " + "x" * (5 * 1024 * 1024) + "\necho big-ok"
    r = sh(backend, held, command)
    assert r.success and r.output == "big-ok\n", (r.error, r.output[:200])


def test_five_megabyte_stdin_and_content(backend: ToolBackend, held: Slot) -> None:
    data = "y" * (5 * 1024 * 1024)
    r = sh(backend, held, "wc -c", stdin=data)
    assert r.success and r.output.strip() == str(len(data)), (r.error, r.output[:200])
    w = one(backend, held, "write_file", {"path": "scratch/big.txt", "content": data})
    assert w.success, w.error
    r = sh(backend, held, "wc -c < ../../scratch/big.txt")
    assert r.output.strip() == str(len(data)), r


def test_env_and_stdin_edge_values(backend: ToolBackend, held: Slot) -> None:
    r = sh(backend, held, 'printf "%s" "$ONE_CALL"', env={"ONE_CALL": "a\nb ' \" $x"})
    assert r.success and r.output == "a\nb ' \" $x", r
    r = sh(backend, held, "cat", stdin="")
    assert r.success and r.output == "", r


# -- file tools: paths with NULs, newlines, escapes, huge names ----------------------------

@pytest.mark.parametrize("tool", ["read_file", "write_file", "list_files", "read_artifact",
                                  "list_artifacts", "archive_artifacts"])
@pytest.mark.parametrize("path", ["a\x00b", "\x00", "keep/\x00/x"])
def test_path_with_nul_is_refused_naming_it(backend: ToolBackend, held: Slot, tool: str, path: str) -> None:
    failed_naming(one(backend, held, tool, {**VALID[tool], "path": path}), "path", "NUL")


@pytest.mark.parametrize("tool", ["read_file", "write_file", "read_artifact"])
@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "keep/../../x", "/", "/data"])
def test_path_outside_the_workspace(backend: ToolBackend, held: Slot, tool: str, path: str) -> None:
    """Without a layered root, a path outside the workspace is refused, naming it. With one,
    paths are in the slot's own view (as in a container): they work, or fail naming the
    resolved path, and the host's files never change."""
    before = Path("/etc/passwd").read_bytes()
    r = one(backend, held, tool, {**VALID[tool], "path": path})
    if not layered(backend):
        failed_naming(r, repr(path))
    elif path in ("/", "/data"):
        failed_naming(r, "directory")
    elif not r.success:
        assert r.error and "/data/x" in r.error, r.error
    assert Path("/etc/passwd").read_bytes() == before


def test_newline_and_odd_names_are_ordinary_files(backend: ToolBackend, held: Slot) -> None:
    for name in ["scratch/new\nline.txt", "scratch/ sp ace ", "scratch/-dash", "scratch/'q\"", "scratch/\u00e9\u4e2d"]:
        w = one(backend, held, "write_file", {"path": name, "content": name})
        assert w.success, (name, w.error)
        r = one(backend, held, "read_file", {"path": name})
        assert r.success and r.output == name, (name, r)


@pytest.mark.parametrize("path", ["x" * 300, "scratch/" + "y" * 5000])
def test_too_long_names_fail_naming_the_path(backend: ToolBackend, held: Slot, path: str) -> None:
    r = one(backend, held, "write_file", {"path": path, "content": "z"})
    assert isinstance(r, ExecutionResult)
    failed_naming(r)
    assert not r.error.startswith(RAW_PYTHON_ERRORS + ("OSError",)), f"raw Python error: {r.error[:120]!r}"
    assert path[:20] in r.error, r.error[:200]


def test_huge_int_arguments_fail_naming_the_argument(backend: ToolBackend, held: Slot) -> None:
    """Ints beyond C's range (JSON allows them) must not surface as a bare OverflowError."""
    for tool, args in [("read_file", {"path": "keep/treasure.txt", "encoding": "base64", "offset": 10**20}),
                       ("read_file", {"path": "keep/treasure.txt", "encoding": "base64", "limit": 10**20}),
                       ("read_artifact", {"path": "keep/treasure.txt", "max_bytes": 10**20}),
                       ("list_files", {"path": "keep", "max_entries": 10**20}),
                       ("archive_artifacts", {"path": "keep", "max_bytes": 10**20, "max_entries": 10**20})]:
        r = one(backend, held, tool, args)
        if not r.success:
            key = next(k for k in args if isinstance(args[k], int))
            assert key in r.error, (tool, args, r.error)
