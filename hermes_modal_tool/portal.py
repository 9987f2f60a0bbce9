"""A sync portal onto the async engine: one background event-loop thread per process.

Sync facades (the Hermes ``terminal_tool``, LangChain's ``_run``) submit coroutines
here; they never create a new event loop per call. Works from plain sync code,
from several threads at once, and from inside a running event loop on another
thread (the caller's thread blocks until the result is ready).
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from . import loops
from .errors import UsageError

T = TypeVar("T")


class LoopThread:
    """A daemon thread running one asyncio event loop forever (until :meth:`close`)."""

    def __init__(self) -> None:
        self.loop = loops.new_event_loop()  # uvloop when installed (loops.UVLOOP_ENV)
        self._thread = threading.Thread(target=self._main, name="hermes-modal-tool-loop", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop thread and wait for its result (``timeout`` in seconds).

        Raises:
            UsageError: called from the loop thread itself (it would deadlock).
            TimeoutError: no result within ``timeout`` (the coroutine is cancelled).
        """
        if threading.current_thread() is self._thread:
            coro.close()
            raise UsageError("the sync API was called from its own event-loop thread; await the async API instead")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except BaseException:
            # A timeout, Ctrl-C or any exit of the caller stops the work (its processes are killed).
            future.cancel()
            raise

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


_lock = threading.Lock()
_portal: LoopThread | None = None


def portal() -> LoopThread:
    """The process's loop thread, started on first use."""
    global _portal
    with _lock:
        if _portal is None or _portal.loop.is_closed():
            _portal = LoopThread()
        return _portal


def run_sync(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run a coroutine on the process's loop thread from sync code; return its result."""
    return portal().run(coro, timeout)


def _close_at_exit() -> None:
    if _portal is not None:
        _portal.close()


atexit.register(_close_at_exit)
