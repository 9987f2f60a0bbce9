"""The Hermes terminal_tool and plugin handler given bad input: bad types or timeouts
give a JSON error (exit_code -1) naming the argument; the task's shell survives.
(Its own module: no other backend may run while its leftover check runs.)"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import SHM_DIR, TOKEN_VAR, Leftovers, describe

from hermes_modal_tool.adapters.hermes import (
    cleanup_all_environments,
    run_terminal_call,
    terminal_tool,
)
from hermes_modal_tool.adapters.hermes_plugin import handle_tool_call

# -- terminal_tool -----------------------------------------------------------------------------------

@pytest.fixture
def terminal_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Small sandboxes whose slots carry a token; state in a private directory; every
    backend stopped after the test and nothing left behind."""
    for var in list(os.environ):
        if var.startswith(("TERMINAL_", "ATROPOS_MODAL_")):
            monkeypatch.delenv(var)
    token = uuid.uuid4().hex
    monkeypatch.setenv("TERMINAL_MODAL_SLOTS_PER_SANDBOX", "2")
    monkeypatch.setenv("TERMINAL_MODAL_MAX_SANDBOXES", "1")
    monkeypatch.setenv("TERMINAL_MODAL_MEMORY", "1024")
    monkeypatch.setenv("TERMINAL_MODAL_ENV_VARS", f"{TOKEN_VAR}={token}")
    state = Path(tempfile.mkdtemp(prefix="hmt-input-hermes-", dir="/tmp"))
    state.chmod(0o711)
    monkeypatch.setattr(tempfile, "tempdir", str(state))
    cleanup_all_environments()
    leftovers = Leftovers(token)
    try:
        yield
    finally:
        shm = {m.decode() for p in leftovers.processes() for m in SHM_DIR.findall(p.cmdline)}
        cleanup_all_environments()
        deadline = time.monotonic() + 3
        while (leftovers.processes() or any(map(os.path.exists, shm))) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = list(state.iterdir())
        shutil.rmtree(state, ignore_errors=True)
        assert not leftovers.processes(), f"left behind: {describe(leftovers.processes())}"
        assert not left, f"state left behind: {left}"


def hermes(command: Any = "true", **kwargs: Any) -> dict[str, Any]:
    try:
        raw = terminal_tool(command, **kwargs)
    except Exception as exc:  # noqa: BLE001 - terminal_tool must never raise
        raise AssertionError(f"terminal_tool raised {type(exc).__name__}: {exc}") from exc
    out = json.loads(raw)
    assert set(out) == {"output", "exit_code", "error"}, out
    return out


HERMES_BAD: list[tuple[dict[str, Any], list[str]]] = [
    ({"command": 5}, ["command"]),
    ({"command": None}, ["command"]),
    ({"command": ["ls"]}, ["command"]),
    ({"command": "a\x00b"}, ["NUL"]),
    ({"timeout": -1}, ["timeout"]),
    ({"timeout": 0}, ["timeout"]),
    ({"timeout": math.nan}, ["timeout"]),
    ({"timeout": math.inf}, ["timeout"]),
    ({"timeout": 10**400}, ["timeout"]),
    ({"timeout": 1e12}, ["timeout"]),
    ({"timeout": "abc"}, ["timeout"]),
    ({"timeout": [1]}, ["timeout"]),
    ({"background": "maybe"}, ["background"]),
    ({"task_id": 5}, ["task_id", "int"]),
    ({"task_id": ["t"]}, ["task_id", "list"]),
    ({"profile": "nope"}, ["'nope'"]),
    ({"profile": 5}, ["profile", "5"]),
]


def test_hermes_bad_arguments_come_back_as_json_errors_and_keep_the_task(terminal_env: None) -> None:
    setup = hermes("mkdir -p h && cd h && export HK=1", task_id="hx")
    assert setup["exit_code"] == 0, setup
    problems = []
    for kwargs, words in HERMES_BAD:
        kwargs = {"task_id": "hx", **kwargs}
        command = kwargs.pop("command", "echo should-not-run")
        try:
            out = hermes(command, **kwargs)
        except AssertionError as exc:
            problems.append(f"{kwargs} command={command!r}: {exc}")
            continue
        if out["exit_code"] != -1 or not out["error"]:
            problems.append(f"{kwargs} command={command!r}: not refused: {out}")
        elif missing := [w for w in words if w not in out["error"]]:
            problems.append(f"{kwargs} command={command!r}: {missing} not in {out['error']!r}")
    after = hermes('echo "$PWD $HK"', task_id="hx")
    assert after["output"].strip().endswith("/h 1"), after
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("args", "words"), [
    ("ls", ["object", "str"]), (None, ["object", "NoneType"]), ([("command", "ls")], ["object", "list"]),
    ({}, ["command"]), ({"command": "ls", "cmd": "x"}, ["cmd"]), ({"command": "ls", "env": {}}, ["env"]),
])
def test_hermes_plugin_handler_bad_args(args: Any, words: list[str]) -> None:
    for fn in (lambda: handle_tool_call(args, task_id="p"), lambda: run_terminal_call(args, task_id="p")):
        out = json.loads(fn())
        assert out["exit_code"] == -1, out
        for w in words:
            assert w in out["error"], out
