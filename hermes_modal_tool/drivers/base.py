"""The driver interface: start a sandbox and hand back a byte channel to its agent.

A driver knows how to start a sandbox running the in-sandbox agent
(:mod:`hermes_modal_tool.agent`), how to tell whether it is still running, and
how to terminate it. Slots, sessions, timeouts and files are the agent's job
and the same for every driver, like an HTTP client over interchangeable transports.
"""

from __future__ import annotations

import abc
from typing import Any

from ..config import SandboxConfig


class SandboxHandle(abc.ABC):
    """A started sandbox: the agent's stdio as a byte channel, plus poll/terminate.

    ``read()`` returns the next chunk of the agent's stdout, ``b""`` once it is
    closed. ``write()`` queues bytes for the agent's stdin without blocking.
    """

    sandbox_id: str

    @abc.abstractmethod
    async def read(self) -> bytes: ...

    @abc.abstractmethod
    def write(self, data: bytes) -> None: ...

    def attach(self, on_data, on_close) -> bool:
        """Optionally deliver the agent's output by callback instead of :meth:`read`.

        ``on_data(bytes)`` is called for each chunk, ``on_close()`` once at the end.
        Return True if the handle does this (saves a task hop per message).
        """
        return False

    @abc.abstractmethod
    def poll(self) -> str | None:
        """None while running, else why it ended (e.g. ``"exited with code 1"``)."""

    @abc.abstractmethod
    async def terminate(self) -> None:
        """Stop the sandbox and everything in it; wait (bounded) until it is gone."""


class Driver(abc.ABC):
    """Starts sandboxes for one profile's pool."""

    name: str

    @abc.abstractmethod
    async def start_sandbox(self, config: SandboxConfig, sandbox_id: str) -> tuple[SandboxHandle, dict[str, Any]]:
        """Start a sandbox running the agent; return its handle and the agent's init config.

        Raises:
            SandboxStartError: the sandbox could not be started.
        """

    def started(self, init: dict[str, Any], info: dict[str, Any]) -> None:
        """Called with a sandbox's init config and its agent's init reply once it is ready
        (what a driver may remember for the next start); the default does nothing."""
        return None

    def describe(self) -> dict[str, Any]:
        """Facts for ``get_status()`` (isolation, bwrap path, ...)."""
        return {"driver": self.name}

    async def aclose(self) -> None:
        """Release what the driver holds (state directories); sandboxes are stopped by the pool."""
        return None
