"""Calling the engine from LangChain's and Deep Agents' code: from any thread or loop.

Shared by the LangChain tools (:mod:`.langchain`) and the Deep Agents backend
(:mod:`._slot_sandbox`), so that neither imports the other's private names. Imports no
LangChain package.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from hermes_modal_tool.backend import ToolBackend
from hermes_modal_tool.errors import UsageError
from hermes_modal_tool.portal import portal, run_sync

__all__ = ["NO_TIMEOUT_S", "acall", "call", "home_loop", "new_key", "thread_key"]

T = TypeVar("T")

#: ``execute(timeout=0)`` means "no timeout" in Deep Agents; the longest we allow.
NO_TIMEOUT_S = 86400.0


# -- calling the engine from any thread or loop ---------------------------------------

def home_loop(backend: ToolBackend) -> asyncio.AbstractEventLoop | None:
    """The event loop ``backend`` runs on, or None before its first pool starts."""
    loop = getattr(backend, "loop", None)
    if isinstance(loop, asyncio.AbstractEventLoop):
        return loop
    # ToolBackend does not expose its loop yet; its pools' reaper tasks know it.
    for pool in getattr(backend, "_pools", {}).values():
        task = getattr(pool, "_reaper", None)
        if task is not None:
            return task.get_loop()
    return None


async def acall(backend: ToolBackend, coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` on the backend's loop (directly when that is the running loop)."""
    home = home_loop(backend)
    if home is None or home is asyncio.get_running_loop():
        return await coro
    if home.is_closed() or not home.is_running():
        coro.close()
        raise UsageError("the backend's event loop is not running; start the backend with "
                         "hermes_modal_tool.portal.run_sync(backend.start()) to share it across loops")
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, home))


def call(backend: ToolBackend, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the backend's loop from sync code and wait for its result."""
    home = home_loop(backend)
    if home is None or home is portal().loop:
        return run_sync(coro)
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is home or home.is_closed() or not home.is_running():
        coro.close()
        raise UsageError("sync call into a backend whose event loop is busy with this call or not "
                         "running; use the async API (ainvoke, aexecute), or start the backend "
                         "with hermes_modal_tool.portal.run_sync(backend.start())")
    return asyncio.run_coroutine_threadsafe(coro, home).result()


def thread_key(config: Mapping[str, Any] | None) -> str | None:
    """A LangChain run config's ``configurable.thread_id``, as a string (None without one)."""
    thread = ((config or {}).get("configurable") or {}).get("thread_id")
    return None if thread is None else str(thread)


def new_key() -> str:
    """A fresh session key for a tool or backend used without a thread id."""
    return f"langchain-{uuid.uuid4().hex[:12]}"
