"""The calls of one ``execute_batch`` to one sandbox, as one unit on the host.

What bounds the calls/s of many sandboxes is the host's one event loop: every call's
bookkeeping runs there, whatever the number of cores (``benchmarks/_scaling.py``). So a
batch's calls to one sandbox (without a listener) share what can be shared: they go in
one ``calls`` frame and come back in ``results`` frames (``protocol.py``), and here they
share one completion and one deadline (:class:`CallGroup`) instead of a future and a
deadline each.

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
from collections.abc import Callable
from typing import Any

from . import tracing


class CallGroup:
    """A batch's compact calls to one sandbox: their ids, their outcomes (the agent's reply
    ``{"ok": ..., "result": ...}``, or an exception) in the order they were added, and
    ``on_complete``, called once every call has its outcome (a group complete before it is
    set is one whose ``left`` is 0: see gather_outcomes)."""

    __slots__ = ("mids", "outcomes", "left", "wait_s", "timer", "queued", "on_complete")

    def __init__(self) -> None:
        self.mids: dict[int, int] = {}  # request id -> position in outcomes
        self.outcomes: list[Any] = []
        self.left = 0
        self.wait_s = 0.0
        self.timer: list | None = None  # the deadline's entry in the sandbox's Deadlines
        self.queued: set[int] = set()  # ids the agent reported queued and not started yet
        # Called with the group where its last outcome arrives (the sandbox's reader).
        self.on_complete: Callable[[CallGroup], None] | None = None

    def add(self, mid: int, wait_s: float) -> None:
        self.mids[mid] = len(self.outcomes)
        self.outcomes.append(None)
        self.left += 1
        if wait_s > self.wait_s:
            self.wait_s = wait_s

    def answer(self, mid: int, outcome: Any) -> bool:
        """Record call ``mid``'s outcome (the first one only); True once the group is complete."""
        pos = self.mids.get(mid)
        if pos is None or self.outcomes[pos] is not None:
            return False
        self.outcomes[pos] = outcome
        self.left -= 1
        if self.left:
            return False
        if self.on_complete is not None:
            self.on_complete(self)
        return True

    def outcome(self, mid: int) -> Any:
        return self.outcomes[self.mids[mid]]

    def unanswered(self) -> list[int]:
        """The ids of the calls with no outcome yet, last added first."""
        return [mid for mid, pos in reversed(self.mids.items()) if self.outcomes[pos] is None]


def by_sandbox(valid: list[tuple]) -> dict[Any, list[tuple]]:
    """A batch's valid requests (``(index, slot, tool, args, pool)``) by the sandbox of
    their slot's lease (None for a slot whose lease is gone: its call fails when
    submitted), in first-use order, each sandbox's in input order (so that a slot's calls
    keep theirs)."""
    out: dict[Any, list[tuple]] = {}
    for item in valid:
        rec = item[1]._sandbox
        key = getattr(rec, "sandbox", None)
        bucket = out.get(key)
        if bucket is None:
            out[key] = [item]
        else:
            bucket.append(item)
    return out


async def gather_outcomes(waiting: list[tuple], groups: dict[Any, CallGroup], touched: dict[Any, None],
                          spans: dict[int, tuple[Any, float]],
                          finish: Callable[[tuple, Any], None]) -> None:
    """``execute_batch``'s wait: ``finish(entry, outcome)`` for each waiting call with its
    outcome (the agent's reply, or an exception): a sandbox's calls as soon as its
    :class:`CallGroup` is complete, where its last result arrives (while other sandboxes'
    calls still run, so that the results are made meanwhile, not all after the last, and
    the task wakes once for the batch, not once per sandbox); a call with a listener from
    its own future, one after another, not gather(): a batch's results come in one frame,
    so the task wakes once and finds the rest done (gather schedules a callback per
    future: a loop pass each).

    ``waiting``: ``(index, pool, tool, slot, sandbox, id, group or future, execution id,
    record)`` per call sent; ``touched``: the sandboxes written to; ``spans``: request
    index -> (span, start) when traced.

    Cancelled (the awaiting task): tells the agent to stop every call that has not
    answered, last ones first and in one write per sandbox, so that a call queued behind
    a cancelled one in its slot is dropped before that one ends, never started; ends the
    calls' spans; re-raises."""
    members: dict[CallGroup, list[tuple]] = {}
    alone = []
    for w in waiting:
        waiter = w[6]
        if isinstance(waiter, CallGroup):
            members.setdefault(waiter, []).append(w)
        else:
            alone.append(w)
    finished: set[int] = set()
    all_done = asyncio.get_running_loop().create_future()
    left = [len(members)]

    def complete(group: CallGroup) -> None:
        # Where the group's last outcome arrives (Sandbox._on_data): its results are made
        # there, and the task wakes once, when the last group is complete.
        group.on_complete = None
        if all_done.done():
            return
        try:
            for w in members[group]:
                finished.add(w[0])
                finish(w, group.outcome(w[5]))
        except BaseException as exc:  # noqa: BLE001 - raised in the task, not in the reader
            all_done.set_exception(exc)
            return
        left[0] -= 1
        if not left[0]:
            all_done.set_result(None)

    try:
        if not members:
            all_done.set_result(None)
        for group in members:
            if group.left:
                group.on_complete = complete
            else:
                complete(group)
        await all_done
        for w in alone:
            try:
                outcome = await w[6]
            except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:
                outcome = exc
            finished.add(w[0])
            finish(w, outcome)
    except asyncio.CancelledError:
        for group in members:
            group.on_complete = None
        for sb, group in groups.items():
            sb.abandon(group)
        for i, pool, _, slot, sb, mid, waiter, _, rec in reversed(waiting):
            if i in finished:
                continue
            if not isinstance(waiter, CallGroup) and (not waiter.done() or waiter.cancelled()):
                sb.cancel(mid, flush=False)
            pool.call_ended(rec, slot)
        for sb in touched:
            sb.flush()
        for i, (span, _) in spans.items():
            if i not in finished:
                tracing.end_error(span, asyncio.CancelledError("the batch was cancelled"))
        raise
