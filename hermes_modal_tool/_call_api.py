"""``ToolBackend``'s single-call methods: ``execute`` and ``execute_stream`` (a mixin over
``execute_batch``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from . import streaming
from .slots import ExecutionResult, OutputEvent, Slot


class CallMethods:
    """Mixed into :class:`~hermes_modal_tool.backend.ToolBackend`: needs its ``execute_batch``."""

    async def execute(self, slot: Slot, tool: str, args: Mapping[str, Any], timeout_s: float | None = None,
                      on_output: Callable[[OutputEvent], Any] | None = None) -> ExecutionResult:
        """One tool call (``execute_batch`` of one)."""
        return (await self.execute_batch([(slot, tool, args)], timeout_s, on_output))[0]  # type: ignore[attr-defined, no-any-return]

    def execute_stream(self, slot: Slot, tool: str, args: Mapping[str, Any],
                       timeout_s: float | None = None) -> AsyncIterator[OutputEvent | ExecutionResult]:
        """One tool call whose output comes as it is written: an async iterator of
        :class:`OutputEvent` (stdout and stderr chunks, in order), then the
        :class:`ExecutionResult` (arguments as :meth:`execute`). Closing it early
        (``aclose()``; ``contextlib.aclosing`` to ``break``) cancels the call, killing
        its processes. Raises as :meth:`execute_batch` when iterated.

        Example:
            >>> async def tail(backend, slot):
            ...     async for item in backend.execute_stream(slot, "bash", {"command": "make"}):
            ...         if isinstance(item, OutputEvent):
            ...             print(item.data, end="")
            ...     return item  # the ExecutionResult
        """
        return streaming.stream_one(
            lambda on_output: self.execute_batch([(slot, tool, args)], timeout_s, on_output))  # type: ignore[attr-defined]
