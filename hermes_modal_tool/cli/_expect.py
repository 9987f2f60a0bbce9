"""A batch call's ``expect``: what a result must show, and the strict rules for writing it.

Keys (each checked only when given):
- ``returncode`` (int), ``success`` (bool), ``timed_out`` (bool): the result's fields.
- ``output_contains`` (str): a substring of the output (stdout and stderr together).
- ``output_matches`` (str): a regular expression searched in the output (``re.M``).
- ``tests_ran`` (int >= 1): the number of tests that a ``unittest`` (``Ran N tests``) or
  ``pytest`` (``N passed, M failed``) run in the call reports; a run that reports none
  (Python 3.12's ``NO TESTS RAN``, or 3.11's ``Ran 0 tests ... OK``) never meets it.

A call without ``expect`` expects success. An expectation on the output with none of
``returncode``/``success``/``timed_out`` also expects success, so an error message that
happens to contain the text (``bash: cd: /root/proj: No such file or directory`` holds
``/proj``) never meets an expectation about a command that worked.

``--strict`` (:func:`strict_problems`) refuses a file, before anything starts, where a
``bash`` call's output expectation does not name its exit code, or where a call that runs
tests does not say how many must run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

EXPECT_KEYS = {"returncode": "code", "success": "bool", "timed_out": "bool", "output_contains": "str",
               "output_matches": "regex", "tests_ran": "count"}
TYPE_WORDS = {"str": "a string", "bool": "true or false", "code": "an integer",
              "regex": "a regular expression (a string)", "count": "an integer >= 1"}
_OUTCOME = ("returncode", "success", "timed_out")
_OUTPUT = ("output_contains", "output_matches", "tests_ran")
_UNITTEST = re.compile(r"^Ran (\d+) tests? in ", re.M)
_PYTEST = re.compile(r"\b(\d+) (passed|failed|errors?)\b")
_RUNS_TESTS = re.compile(r"\b(unittest|pytest)\b")


def check_value(key: str, value: Any) -> str | None:
    """Why ``value`` cannot be ``expect[key]`` (None when it can)."""
    kind = EXPECT_KEYS.get(key)
    if kind is None:
        return f"expect has no key {key!r}; it takes: {', '.join(EXPECT_KEYS)}"
    ok = {"str": isinstance(value, str), "bool": isinstance(value, bool),
          "code": isinstance(value, int) and not isinstance(value, bool),
          "count": isinstance(value, int) and not isinstance(value, bool) and value >= 1,
          "regex": isinstance(value, str)}[kind]
    if not ok:
        return f"expect {key!r} must be {TYPE_WORDS[kind]}, got {value!r:.80}"
    if kind == "regex":
        try:
            re.compile(value)
        except re.error as exc:
            return f"expect 'output_matches' is not a valid regular expression ({exc}): {value!r:.80}"
    return None


def reported_test_count(output: str) -> int | None:
    """How many tests the output's last ``unittest`` or ``pytest`` summary reports (None: no summary)."""
    runs = _UNITTEST.findall(output)
    if runs:
        return int(runs[-1])
    lines = [ln for ln in output.splitlines() if _PYTEST.search(ln) and " in " in ln]
    if lines:
        return sum(int(n) for n, _ in _PYTEST.findall(lines[-1]))
    return None


def check_expectations(expect: Mapping[str, Any], r: Any) -> list[str]:
    """The expectations ``r`` (an ExecutionResult) does not meet, each as 'key: expected X, got Y'."""
    got = {"returncode": r.returncode, "success": r.success, "timed_out": bool(r.metadata.get("timed_out"))}
    want = dict(expect)
    if not any(key in want for key in _OUTCOME):
        want["success"] = True  # an output expectation alone is about a command that worked
    problems = [f"{key}: expected {json.dumps(want[key])}, got {json.dumps(got[key])}"
                for key in _OUTCOME if key in want and got[key] != want[key]]
    needle = want.get("output_contains")
    if needle is not None and needle not in r.output:
        problems.append(f"output_contains: {needle!r} not in output")
    pattern = want.get("output_matches")
    if pattern is not None and not re.search(pattern, r.output, re.M):
        problems.append(f"output_matches: no match for {pattern!r} in output")
    count = want.get("tests_ran")
    if count is not None:
        ran = reported_test_count(r.output)
        if ran != count:
            problems.append(f"tests_ran: expected {count}, got "
                            + ("no test summary in the output" if ran is None else str(ran)))
    return problems


def strict_problems(calls: Iterable[tuple[str, Any]]) -> list[str]:
    """What ``--strict`` refuses in ``(where, call)`` pairs: output expectations without an
    exit code, and test runs that do not say how many tests must run."""
    problems = []
    for where, call in calls:
        if call.tool != "bash":
            continue
        expect = call.expect
        if any(key in expect for key in _OUTPUT) and "returncode" not in expect \
                and not expect.get("timed_out"):
            problems.append(f"{where}: an expectation on the output must also give 'returncode'")
        if _RUNS_TESTS.search(call.args.get("command", "")) and "tests_ran" not in expect:
            problems.append(f"{where}: a call that runs tests must give 'tests_ran' (how many must run)")
    return problems
