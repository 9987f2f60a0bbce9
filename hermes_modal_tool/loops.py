"""The event loop the package makes for itself: uvloop when installed, else the stdlib's.

The package makes its own loop in two places: the sync portal's background thread
(:mod:`hermes_modal_tool.portal`, behind the sync facades and adapters) and the command
line (``hermes-modal-tool ...``). Both use :func:`new_event_loop`. Async callers run the
engine on whatever loop they run (``uvloop.run(main())`` to get uvloop there).

``uvloop`` (the optional extra ``hermes-modal-tool[uvloop]``) is a drop-in asyncio loop on
libuv; ``HERMES_MODAL_TOOL_UVLOOP=0`` (or ``false``/``no``/``off``) keeps the stdlib loop
even where it is installed. What it changes is measured in ``benchmarks/engine.py
--sections s`` (the same run, both loops).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

from .errors import ConfigError

T = TypeVar("T")

#: Environment variable: ``0``/``false``/``no``/``off`` turns uvloop off, ``1``/``true``/
#: ``yes``/``on`` or unset uses it when importable.
UVLOOP_ENV = "HERMES_MODAL_TOOL_UVLOOP"
_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")


def uvloop_wanted() -> bool:
    """Whether :data:`UVLOOP_ENV` allows uvloop (unset: yes).

    Raises:
        ConfigError: the variable holds something else (named with its value).
    """
    value = os.environ.get(UVLOOP_ENV, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ConfigError(f"{UVLOOP_ENV}={os.environ[UVLOOP_ENV]!r}: expected 0/1, true/false, yes/no or on/off")


def loop_kind() -> str:
    """``"uvloop"`` or ``"asyncio"``: what :func:`new_event_loop` makes here and now."""
    if uvloop_wanted():
        try:
            import uvloop  # noqa: F401
        except ImportError:
            return "asyncio"
        return "uvloop"
    return "asyncio"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when installed and not turned off (:data:`UVLOOP_ENV`),
    else ``asyncio.new_event_loop()``.

    Raises:
        ConfigError: :data:`UVLOOP_ENV` holds an unknown value.
    """
    if loop_kind() == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` on :func:`new_event_loop`'s loop (Python 3.11+: ``asyncio.Runner``
    with it as the loop factory; 3.10 has no loop factory and keeps ``asyncio.run``)."""
    if sys.version_info < (3, 11):
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)
