"""The calls of one ``execute_batch`` to one sandbox, as one unit on the host.

What bounds the calls/s of many sandboxes is the host's one event loop: every call's
bookkeeping runs there, whatever the number of cores (``benchmarks/_scaling.py``). So a
batch's calls to one sandbox (without a listener) share what can be shared: they go in
one ``calls`` frame and come back in ``results`` frames (``protocol.py``), and here they
share one completion and one deadline (:class:`CallGroup`) instead of a future and a
deadline each, their ids are consecutive (a call's place in its group is its id less the
group's first), and their results are made together where the group completes
(:meth:`~hermes_modal_tool._pool_calls.PoolCalls.group_results`).

The deadline keeps the per-call rule of ``sandbox.py``: a group waits at most the
longest wait of its calls (each call's timeout plus ``HOST_GRACE_S``) from when it was
sent, and not while any of its calls is ``queued`` in the agent (waiting behind another
call of its slot, for admission or for its shell): the clock stops at the first
``queued`` and starts again, whole, once every queued call has ``started``. A group
whose deadline passes fails the calls that have not answered (SandboxError) and asks the
agent to stop them. Since the deadline is a guard against an agent that stopped
answering, not a call's timeout (the agent enforces that), one per group is enough.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from . import tracing
from .errors import UsageError
from .slots import ExecutionResult, Slot


class Reply:
    """A grouped call's outcome that came as a reply frame of its own (``{"id", "ok",
    "error"?, "result"?}``: the agent refused it, or answered it outside a ``results``
    frame); :meth:`PoolCalls.to_result` reads ``message`` as a ``call``'s reply."""

    __slots__ = ("message",)

    def __init__(self, message: dict[str, Any]) -> None:
        self.message = message


class CallGroup:
    """A batch's compact calls to one sandbox, in the order they were queued.

    ``members``: ``(request index, slot, tool, slot record)`` per call (the pool's);
    ``first``: the first call's id (the others follow, one each); ``outcomes``: per call,
    its result (the agent's ``call`` result, a dict), a :class:`Reply`, or an exception;
    None until it comes. ``on_complete`` is called once every call has its outcome (a
    group complete before it is set is one whose ``left`` is 0)."""

    __slots__ = ("pool", "members", "first", "outcomes", "left", "wait_s", "timer", "queued",
                 "on_complete")

    def __init__(self, pool: Any = None) -> None:
        self.pool = pool
        self.members: list[tuple[int, Any, str, Any]] = []
        self.first = 0
        self.outcomes: list[Any] = []
        self.left = 0
        self.wait_s = 0.0
        self.timer: list | None = None  # the deadline's entry in the sandbox's Deadlines
        self.queued: set[int] = set()  # ids the agent reported queued and not started yet
        # Called with the group where its last outcome arrives (the sandbox's reader).
        self.on_complete: Callable[[CallGroup], None] | None = None

    def open(self, first: int, n: int) -> None:
        """The group's ``n`` calls have the ids ``first``, ``first + 1``, ..."""
        self.first = first
        self.outcomes = [None] * n
        self.left = n

    def answer(self, mid: int, outcome: Any) -> bool:
        """Record call ``mid``'s outcome (the first one only); True once the group is complete."""
        pos = mid - self.first
        outcomes = self.outcomes
        if pos < 0 or pos >= len(outcomes) or outcomes[pos] is not None:
            return False
        outcomes[pos] = outcome
        self.left -= 1
        if self.left:
            return False
        if self.on_complete is not None:
            self.on_complete(self)
        return True

    def outcome(self, mid: int) -> Any:
        return self.outcomes[mid - self.first]

    def unanswered(self) -> list[int]:
        """The ids of the calls with no outcome yet, last added first."""
        first, outcomes = self.first, self.outcomes
        return [first + pos for pos in range(len(outcomes) - 1, -1, -1) if outcomes[pos] is None]


def parse_request(i: int, req: Any) -> tuple[Slot, str, Mapping[str, Any]] | ExecutionResult:
    """Request ``i`` of a batch as ``(slot, tool, args)``, or the failed result that refuses
    it (``reason="bad_request"``, naming what is wrong) when it is not one."""
    try:
        slot, tool, args = req
    except (TypeError, ValueError):
        return _bad_request(f"request {i}: expected (slot, tool, args), got {req!r:.200}")
    if not isinstance(slot, Slot):
        return _bad_request(f"request {i}: expected a Slot, got {type(slot).__name__}")
    if not isinstance(tool, str):
        return _bad_request(f"request {i}: tool must be a string, got {tool!r:.100}", slot.slot_id)
    if type(args) is not dict and not isinstance(args, Mapping):  # the ABC check costs ~1 µs
        return _bad_request(f"request {i}: args must be a dict, got {type(args).__name__}", slot.slot_id)
    return slot, tool, args


def checked_requests(requests: Any, timeout_s: Any
                     ) -> tuple[list[Any], Iterator[tuple[int, Slot, str, Mapping[str, Any]]]]:
    """A batch's results list (one None per request) and its well-formed requests as
    ``(index, slot, tool, args)``; each refused one's failed result is put in the list at
    its index as they are iterated (:func:`parse_request`).

    Raises:
        UsageError: ``requests`` is not a sequence, or ``timeout_s`` is neither None nor a
            positive number of seconds (when called, before any request is looked at).
    """
    if not isinstance(requests, Sequence) or isinstance(requests, (str, bytes)):
        raise UsageError(f"requests must be a list of (slot, tool, args), got {type(requests).__name__}")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not timeout_s > 0):
        raise UsageError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    results: list[Any] = [None] * len(requests)
    return results, _parsed(requests, results)


def _parsed(requests: Sequence[Any], results: list[Any]) -> Iterator[tuple[int, Slot, str, Mapping[str, Any]]]:
    for i, req in enumerate(requests):
        parsed = parse_request(i, req)
        if type(parsed) is ExecutionResult:
            results[i] = parsed
        else:
            yield (i, *parsed)  # type: ignore[misc]


def _bad_request(error: str, slot_id: str | None = None) -> ExecutionResult:
    """A request refused before anything ran (``metadata["reason"] == "bad_request"``)."""
    return ExecutionResult.failure(error, slot_id, "bad_request")


async def execute_grouped(by_sandbox: dict[Any, list[tuple]], results: list[Any], timeout_s: float | None,
                          requests: Sequence[tuple], traced: bool) -> None:
    """``execute_batch`` without a listener: the requests that passed its checks
    (``(index, slot, tool, args, pool)`` each) by the sandbox of their slot's lease, in
    ``by_sandbox`` (None: a lease gone), sent as one :class:`CallGroup` per
    sandbox (``PoolCalls.submit_group``), each flushed as soon as its calls are queued (an
    agent starts on its calls while the host queues the next sandbox's), and
    ``results[index]`` set for each: a refused call's at once, the others' where their
    group completes (in the sandbox's reader, as its last result arrives, while other
    sandboxes' calls still run; the task wakes once, when the last group is complete).

    Cancelled (the awaiting task): tells the agent to stop every call that has not
    answered, last ones first and in one write per sandbox, so that a call queued behind
    a cancelled one in its slot is dropped before that one ends, never started; ends the
    slots' hold and the calls' spans; re-raises."""
    groups: dict[Any, CallGroup] = {}
    spans: dict[int, tuple[Any, float]] = {}  # request index -> (span, start), when traced
    for sandbox, items in by_sandbox.items():
        group = items[0][4].submit_group(sandbox, items, timeout_s, results)
        if group is None:
            continue
        groups[sandbox] = group
        if traced:
            for i, slot, tool, _ in group.members:
                spans[i] = tracing.call_span(slot, tool)
        sandbox.arm(group)
        sandbox.flush()
    if not groups:
        return
    finished: set[CallGroup] = set()
    all_done = asyncio.get_running_loop().create_future()

    def complete(group: CallGroup) -> None:
        # Where the group's last outcome arrives (Sandbox._on_data): its results are made
        # there, and the task wakes once, when the last group is complete.
        group.on_complete = None
        if all_done.done():
            return
        finished.add(group)
        try:
            group.pool.group_results(group, results, requests)
            if traced:
                for member in group.members:
                    i = member[0]
                    tracing.end_call_span(*spans[i], results[i])
        except BaseException as exc:  # noqa: BLE001 - raised in the task, not in the reader
            all_done.set_exception(exc)
            return
        if len(finished) == len(groups):
            all_done.set_result(None)

    try:
        for group in groups.values():
            if group.left:
                group.on_complete = complete
            else:
                complete(group)
        await all_done
    except asyncio.CancelledError:
        for group in groups.values():
            group.on_complete = None
        for sb, group in groups.items():
            sb.abandon(group)
        for group in reversed(groups.values()):
            if group not in finished:
                for i, slot, _, rec in reversed(group.members):
                    group.pool.call_ended(rec, slot)
                    if i in spans:
                        tracing.end_error(spans[i][0], asyncio.CancelledError("the batch was cancelled"))
        raise


async def gather_outcomes(waiting: list[tuple], touched: dict[Any, None],
                          spans: dict[int, tuple[Any, float]],
                          finish: Callable[[tuple, Any], None]) -> None:
    """``execute_batch``'s wait for calls sent one by one (each with a listener):
    ``finish(entry, outcome)`` for each waiting call with its outcome (the agent's reply,
    or an exception) from its own future, one after another, not gather(): a batch's
    results come in one frame, so the task wakes once and finds the rest done (gather
    schedules a callback per future: a loop pass each).

    ``waiting``: ``(index, pool, tool, slot, sandbox, id, future, execution id,
    record)`` per call sent; ``touched``: the sandboxes written to; ``spans``: request
    index -> (span, start) when traced.

    Cancelled (the awaiting task): tells the agent to stop every call that has not
    answered, last ones first and in one write per sandbox (as :func:`execute_grouped`);
    ends the calls' spans; re-raises."""
    finished: set[int] = set()
    try:
        for w in waiting:
            try:
                outcome = await w[6]
            except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:
                outcome = exc
            finished.add(w[0])
            finish(w, outcome)
    except asyncio.CancelledError:
        for i, pool, _, slot, sb, mid, fut, _, rec in reversed(waiting):
            if i in finished:
                continue
            if not fut.done() or fut.cancelled():
                sb.cancel(mid, flush=False)
            pool.call_ended(rec, slot)
        for sb in touched:
            sb.flush()
        for i, (span, _) in spans.items():
            if i not in finished:
                tracing.end_error(span, asyncio.CancelledError("the batch was cancelled"))
        raise
