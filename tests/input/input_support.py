"""Helpers for the bad-input tests: one backend per module on the portal loop.

The backend lives on the sync portal's loop (``hermes_modal_tool.portal``), so
plain sync tests (and hypothesis) can drive it with ``run_sync``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from support import SMALL, Leftovers, describe

from hermes_modal_tool import ExecutionResult, SandboxConfig, Slot, ToolBackend
from hermes_modal_tool.portal import run_sync


@contextmanager
def portal_backend(**fields: Any) -> Iterator[ToolBackend]:
    """A started backend on the portal loop; stopped (and checked for leftovers) on exit."""
    leftovers = Leftovers(uuid.uuid4().hex)
    config = SandboxConfig(**{"name": "in" + uuid.uuid4().hex[:8], **SMALL, **fields})
    backend = ToolBackend(leftovers.tag(config))
    run_sync(backend.start())
    try:
        yield backend
    finally:
        leftovers.note_roots(backend)
        run_sync(asyncio.wait_for(backend.stop(), 30))
        procs, dirs = run_sync(leftovers.remaining())
        assert not procs, f"processes left behind after stop(): {describe(procs)}"
        assert not dirs, f"state directories left behind after stop(): {sorted(dirs)}"


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
