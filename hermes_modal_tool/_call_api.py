"""``ToolBackend``'s single-call methods: ``execute`` and ``execute_stream`` (a mixin over
``execute_batch``), and ``execute_batch``'s path with an ``on_output`` listener."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from . import streaming, tracing
from ._call_group import gather_outcomes
from .slots import ExecutionResult, OutputEvent, Slot, execution_id


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


async def execute_streamed(valid: list[tuple], results: list[Any], timeout_s: float | None,
                           on_output: Callable[[OutputEvent], Any]) -> None:
    """``ToolBackend.execute_batch`` with a listener: each call sent alone (``PoolCalls.submit``,
    its output streamed to ``on_output``), all in one write per sandbox."""
    traced = tracing.active()
    spans: dict[int, tuple[Any, float]] = {}  # request index -> (span, start), when traced
    touched: dict[Any, None] = {}  # sandboxes with frames to send, in first-use order
    waiting: list[tuple[int, Any, str, Slot, Any, int, Any, str, Any]] = []
    for i, slot, tool, args, pool in valid:
        submitted = pool.submit(slot, tool, dict(args), timeout_s, flush=False,
                                listener=streaming.listener(i, slot.slot_id, on_output))
        if isinstance(submitted, ExecutionResult):
            results[i] = submitted
            continue
        sb, mid, fut, rec = submitted
        if traced:
            spans[i] = tracing.call_span(slot, tool)
        touched[sb] = None
        waiting.append((i, pool, tool, slot, sb, mid, fut, execution_id(), rec))
    for sb in touched:
        sb.flush()

    def finish(w: tuple, outcome: Any) -> None:
        i, pool, tool, slot, _sb, _mid, _fut, eid, rec = w
        pool.call_ended(rec, slot)
        results[i] = pool.to_result(slot, tool, outcome, eid)
        if traced:
            tracing.end_call_span(*spans[i], results[i])

    if waiting:
        await gather_outcomes(waiting, touched, spans, finish)
