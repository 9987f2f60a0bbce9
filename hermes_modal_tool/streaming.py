"""Live output of running calls: ``on_output`` callbacks and ``execute_stream``.

The agent sends a call's output as ``output`` events on the sandbox's one stream while
the call runs (see ``hermes_modal_tool/agent/shells/streaming.py``: coalesced, at most one
event per 10 ms and 256 KiB per slot; the last one before the result); here each
event's chunks become :class:`~hermes_modal_tool.slots.OutputEvent` objects.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from .slots import ExecutionResult, OutputEvent

log = logging.getLogger("hermes_modal_tool")

STREAMS = {1: "stdout", 2: "stderr"}
OnOutput = Callable[[OutputEvent], Any]


def listener(index: int, slot_id: str, on_output: OnOutput) -> Callable[[dict[str, Any]], None]:
    """A sandbox listener that turns the agent's ``output`` events into calls of
    ``on_output(OutputEvent)``; an exception it raises is logged, never propagated
    into the sandbox's reader."""
    def listen(msg: dict[str, Any]) -> None:
        raw = bool(msg.get("b64"))
        for stream, data in msg.get("chunks") or ():
            value: str | bytes = base64.b64decode(data) if raw else data
            try:
                on_output(OutputEvent(index, slot_id, STREAMS.get(stream, "stdout"), value))
            except Exception:  # noqa: BLE001 - a callback's failure must not kill the reader
                log.exception("on_output callback failed for call %d in slot %s", index, slot_id)
    return listen


async def stream_one(run: Callable[[OnOutput], Awaitable[list[ExecutionResult]]],
                     ) -> AsyncIterator[OutputEvent | ExecutionResult]:
    """Run ``run(on_output)`` (an ``execute_batch`` of one) in a task owned by this
    generator; yield each :class:`OutputEvent` as it comes, then the result. Closing the
    generator early (``aclose()``, ``break`` inside ``contextlib.aclosing``) or cancelling
    its consumer cancels the call (its processes are killed) and waits for that."""
    queue: asyncio.Queue[OutputEvent | None] = asyncio.Queue()
    task = asyncio.ensure_future(run(queue.put_nowait))
    task.add_done_callback(lambda _t: queue.put_nowait(None))
    try:
        while True:
            item = await queue.get()
            if item is None:
                break
            yield item
        while not queue.empty():  # events queued with the result (none: they come first)
            item = queue.get_nowait()
            if item is not None:
                yield item
        yield task.result()[0]
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
