"""Helpers for the bad-input tests: one backend per module on the portal loop.

The backend lives on the sync portal's loop (``hermes_modal_tool.portal``), so
plain sync tests (and hypothesis) can drive it with ``run_sync``.
"""

from __future__ import annotations

from typing import Any

import support
from support import SMALL

from hermes_modal_tool import ExecutionResult, Slot, ToolBackend
from hermes_modal_tool.portal import run_sync


def portal_backend(**fields: Any):
    """A started backend on the portal loop; stopped (and checked for leftovers) on exit."""
    return support.portal_backend("in", SMALL, **fields)


def batch(backend: ToolBackend, requests: list[Any], timeout_s: float | None = None,
          wait: float = 60) -> list[ExecutionResult]:
    return run_sync(backend.execute_batch(requests, timeout_s), wait)


def one(backend: ToolBackend, slot: Slot, tool: str, args: Any,
        timeout_s: float | None = None) -> ExecutionResult:
    [r] = batch(backend, [(slot, tool, args)], timeout_s)
    return r


def sh(backend: ToolBackend, slot: Slot, command: str, **args: Any) -> ExecutionResult:
    return one(backend, slot, "bash", {"command": command, **args})


def prepare_state(backend: ToolBackend, slot: Slot) -> None:
    """Give ``slot`` state a bad request must not lose: a cwd, a variable, a file."""
    r = sh(backend, slot, "mkdir -p keep/sub && cd keep/sub && export KEEP_VAR=kept-42 "
                          "&& printf precious > ../treasure.txt")
    assert r.success, r


def assert_state_intact(backend: ToolBackend, slot: Slot) -> None:
    """The cwd, the variable and the file of :func:`prepare_state` are all still there."""
    r = sh(backend, slot, 'printf "%s|%s|" "$PWD" "$KEEP_VAR"; cat ../treasure.txt')
    assert r.success, r
    assert r.output == f"{slot.workspace_dir}/keep/sub|kept-42|precious", r.output


def failed_naming(result: ExecutionResult, *words: str) -> None:
    """``result`` is a failed result whose error names every one of ``words``."""
    assert not result.success, f"expected a failure, got {result!r}"
    assert result.error, f"failed without an error message: {result!r}"
    for w in words:
        assert w in result.error, f"error does not name {w!r}: {result.error!r}"
