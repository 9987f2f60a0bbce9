"""The batch file (JSONL): one trajectory per line, each call checked before anything starts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..protocol import TOOL_ARGS, TOOLS, check_args
from ._common import InputError
from ._expect import check_value
from ._transfer_steps import TRANSFER_TOOLS, check_transfer_args

# Each tool's arguments (protocol.TOOL_ARGS) are checked before any sandbox starts.


@dataclass
class Call:
    tool: str
    args: dict[str, Any]
    expect: dict[str, Any]


@dataclass
class Trajectory:
    id: str
    line: int
    calls: list[Call]
    profile: str | None = None
    meta: Any = None
    setup: list[str] | None = None  # shared setup (keyed by content), run before the calls
    fork: str | None = None  # start from this trajectory's state after its calls


def _check_call(call: Any, i: int) -> Call:
    where = f"calls[{i}]"
    if not isinstance(call, dict):
        raise ValueError(f"{where}: expected an object, got {type(call).__name__}")
    unknown = set(call) - {"tool", "args", "expect"}
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, sorted(unknown)))}; "
                         "a call has 'tool', 'args' and optional 'expect'")
    tool = call.get("tool")
    if tool not in TOOL_ARGS and tool not in TRANSFER_TOOLS:
        raise ValueError(f"{where}: tool {tool!r} is not one of: {', '.join(TOOLS + TRANSFER_TOOLS)}")
    args = call.get("args", {})
    if not isinstance(args, dict):
        raise ValueError(f"{where}: 'args' must be an object, got {type(args).__name__}")
    problem = (check_transfer_args(tool, args) if tool in TRANSFER_TOOLS
               else check_args(tool, args))  # the same check the agent makes
    if problem:
        raise ValueError(f"{where}: {problem}")
    expect = call.get("expect")
    if expect is None:
        expect = {"success": True}
    if not isinstance(expect, dict):
        raise ValueError(f"{where}: 'expect' must be an object, got {type(expect).__name__}")
    for key, value in expect.items():
        problem = check_value(key, value)
        if problem:
            raise ValueError(f"{where}: {problem}")
    return Call(tool, dict(args), dict(expect))


def parse_batch(path: str) -> list[Trajectory]:
    """Read and validate a batch file; raise InputError naming the file and line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")  # JSONL lines end with \n only (not U+2028 etc.)
        if lines and lines[-1] == "":
            lines.pop()
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror}") from None
    trajectories: list[Trajectory] = []
    seen: dict[str, int] = {}
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        data: Any = None
        try:
            try:
                data = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"invalid JSON: {exc}") from None
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object, got {type(data).__name__}")
            unknown = set(data) - {"id", "profile", "calls", "meta", "setup", "fork"}
            if unknown:
                raise ValueError(f"unknown key(s) {', '.join(map(repr, sorted(unknown)))}; a trajectory "
                                 "has 'id', 'calls' and optional 'profile', 'meta', 'setup', 'fork'")
            tid = data.get("id")
            if not isinstance(tid, str) or not tid:
                raise ValueError("missing 'id' (a non-empty string)" if tid is None
                                 else f"'id' must be a non-empty string, got {tid!r:.80}")
            if tid in seen:
                raise ValueError(f"id {tid!r} repeats line {seen[tid]}")
            calls = data.get("calls")
            if not isinstance(calls, list):
                raise ValueError("missing 'calls' (a list)" if calls is None
                                 else f"'calls' must be a list, got {type(calls).__name__}")
            profile = data.get("profile")
            if profile is not None and (not isinstance(profile, str) or not profile):
                raise ValueError(f"'profile' must be a non-empty string, got {profile!r:.80}")
            parsed = [_check_call(c, i) for i, c in enumerate(calls)]
            setup = data.get("setup")
            if isinstance(setup, str):
                setup = [setup]
            if setup is not None and (not isinstance(setup, list) or not setup
                                      or not all(isinstance(c, str) and c.strip() for c in setup)):
                raise ValueError(f"'setup' must be a command or a non-empty list of commands, got {setup!r:.80}")
            fork = data.get("fork")
            if fork is not None and (not isinstance(fork, str) or not fork):
                raise ValueError(f"'fork' must be the id of another trajectory, got {fork!r:.80}")
            if fork is not None and setup is not None:
                raise ValueError("give 'setup' or 'fork', not both (a fork starts from the other's state)")
        except ValueError as exc:
            where = f" (id {data['id']!r})" if isinstance(data, dict) and isinstance(data.get("id"), str) else ""
            raise InputError(f"{path}, line {n}{where}: {exc}") from None
        seen[tid] = n
        trajectories.append(Trajectory(tid, n, parsed, profile, data.get("meta"), setup, fork))
    if not trajectories:
        raise InputError(f"{path}: no trajectories (expected one JSON object per line)")
    by_id = {t.id: t for t in trajectories}
    for t in trajectories:
        seen_chain = [t.id]
        cur = t
        while cur.fork is not None:
            parent = by_id.get(cur.fork)
            if parent is None:
                raise InputError(f"{path}, line {cur.line} (id {cur.id!r}): 'fork' names {cur.fork!r}, "
                                 "which is not a trajectory of this file")
            if parent.id in seen_chain:
                raise InputError(f"{path}, line {t.line} (id {t.id!r}): forks form a cycle: "
                                 + " -> ".join(seen_chain + [parent.id]))
            if (parent.profile or None) != (cur.profile or None):
                raise InputError(f"{path}, line {cur.line} (id {cur.id!r}): a fork must use its source's "
                                 f"profile ({parent.profile!r})")
            seen_chain.append(parent.id)
            cur = parent
    return trajectories
