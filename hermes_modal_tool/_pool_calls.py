"""The pool's tool calls (mixed into :class:`~hermes_modal_tool.pool.SandboxPool`): a
call checked and sent to its slot's sandbox, one at a time (:meth:`PoolCalls.submit`) or
grouped per sandbox for a batch (:meth:`PoolCalls.submit_group`, ``_call_group.py``),
counted, and its reply made an :class:`ExecutionResult`.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._call_group import CallGroup, Reply
from ._pool_status import RATE_TICKS_PER_S
from ._slot_record import SlotRecord as _Record
from .errors import HermesModalToolError, SandboxError, UsageError
from .protocol import ProtocolError
from .sandbox import HOST_GRACE_S
from .slots import ExecutionResult, Slot, SlotState, execution_ids

if TYPE_CHECKING:
    from .config import SandboxConfig

#: The longest a call may be given (seconds): a timeout past it is refused.
MAX_CALL_TIMEOUT_S = 86400.0


class PoolCalls:
    """Sending tool calls and turning their replies into results."""

    config: SandboxConfig
    stats: dict[str, int]
    _rate_window: deque

    def record_of(self, slot: Slot) -> _Record:  # pragma: no cover - SandboxPool's
        raise NotImplementedError

    def _new_rate_tick(self, tick: int) -> None:  # pragma: no cover - PoolStatus's
        raise NotImplementedError

    def submit(self, slot: Slot, tool: str, args: dict[str, Any], timeout_s: float | None,
               flush: bool = True, listener: Any = None):
        """Send one tool call; return ``(sandbox, mid, future, record)`` or an
        ExecutionResult on error. The caller hands ``record`` to :meth:`call_ended`
        once the future is done or abandoned.

        With ``flush=False`` the frame waits for the sandbox's ``flush()``; with a
        ``listener`` the agent streams the call's output to it (``output`` events).
        """
        prepared = self._prepare(slot, tool, args, timeout_s)
        if isinstance(prepared, ExecutionResult):
            return prepared
        rec, message, wait = prepared
        if listener is not None:
            message["stream"] = True
        try:
            mid, fut = rec.sandbox.submit(message, wait, flush, listener)
        except ProtocolError as exc:
            return unsendable(slot, tool, args, exc)
        self._count(rec, slot, tool)
        self.count_rate(1)
        return rec.sandbox, mid, fut, rec

    def submit_group(self, sb: Any, items: list[tuple], timeout_s: float | None,
                     results: list[Any]) -> CallGroup | None:
        """Queue a batch's calls to sandbox ``sb`` as one :class:`CallGroup` (see
        ``_call_group.py``; ``items``: ``(request index, slot, tool, args, pool)`` each, in
        input order) and count them (the slot executing, its calls by tool, the pool's
        rate); return the group, or None when no call could be sent. A call that
        cannot be sent (slot not held, sandbox dead, a timeout past the maximum) gets its
        failed ExecutionResult in ``results`` at once. The caller arms and flushes ``sb``,
        and hands each member's record to :meth:`call_ended` (:meth:`group_results` does,
        once the group is complete).

        The checks of :meth:`_prepare`, inline: one call costs the host's loop what it
        must, since that loop serves every sandbox (``benchmarks/_scaling.py``)."""
        timeout = timeout_s if timeout_s is not None else self.config.execution_timeout_s
        group = CallGroup(self)
        members = group.members
        calls = []
        longest = 0.0
        dead = sb is None or sb.dead
        for i, slot, tool, args, _ in items:
            rec = slot._sandbox
            wait = call_wait(tool, args, timeout)
            if (dead or type(rec) is not _Record or rec.holder is not slot or rec.lease != slot._lease
                    or wait > MAX_CALL_TIMEOUT_S):
                refused = self._prepare(slot, tool, args, timeout_s)
                if isinstance(refused, ExecutionResult):
                    results[i] = refused
                    continue
                rec = refused[0]  # a record of a subclass: as valid as ours
            if wait > longest:
                longest = wait
            calls.append([0, rec.index, tool, args if type(args) is dict else dict(args), timeout])
            members.append((i, slot, tool, rec))
            self._count(rec, slot, tool)
        if not members:
            return None
        group.wait_s = float(longest) + HOST_GRACE_S
        sb.submit_group(group, calls)
        self.count_rate(len(members))
        return group

    def group_results(self, group: CallGroup, results: list[Any], requests: Sequence[tuple]) -> None:
        """The complete ``group``'s calls made ExecutionResults, each in ``results`` at its
        request's index (``requests``: the batch's, for a call JSON could not carry), each
        slot's hold ended (:meth:`call_ended`), failures and timeouts counted."""
        ids = execution_ids(len(group.members))
        failures = timeouts = 0
        make = ExecutionResult.from_agent
        for (i, slot, tool, rec), outcome, eid in zip(group.members, group.outcomes, ids, strict=True):
            self.call_ended(rec, slot)
            if type(outcome) is dict:
                result = make(outcome, slot.slot_id, eid, tool)
                meta = result.metadata
                if not result.success:
                    failures += 1
                if meta["timed_out"]:
                    timeouts += 1
            elif isinstance(outcome, ProtocolError):  # a call JSON could not carry
                result = unsendable(slot, tool, requests[i][2], outcome)
            elif isinstance(outcome, Reply):
                result = self.to_result(slot, tool, outcome.message, eid)
            else:
                result = self.to_result(slot, tool, outcome, eid)
            results[i] = result
        if failures:
            self.stats["failures"] += failures
        if timeouts:
            self.stats["timeouts"] += timeouts

    def _prepare(self, slot: Slot, tool: str, args: dict[str, Any], timeout_s: float | None):
        """``(record, call message, host wait in seconds)`` for a call, or the failed
        ExecutionResult of one that cannot be sent (slot not held, sandbox dead, a
        timeout past the maximum)."""
        try:
            rec = self.record_of(slot)
        except UsageError as exc:
            return ExecutionResult.failure(str(exc), slot.slot_id, "slot_not_held")
        sb = rec.sandbox
        if sb.dead:
            return ExecutionResult.failure(f"sandbox {sb.sandbox_id} died: {sb.death_reason}", slot.slot_id,
                                           "sandbox_died")
        timeout = timeout_s if timeout_s is not None else self.config.execution_timeout_s
        wait = call_wait(tool, args, timeout)
        if wait > MAX_CALL_TIMEOUT_S:
            own = args.get("timeout") if tool == "bash" else None
            return ExecutionResult.failure(
                f"timeout {own if own is not None else wait!r:.40} s is longer than the "
                f"{MAX_CALL_TIMEOUT_S:g} s maximum", slot.slot_id, "bad_request")
        message = {"op": "call", "slot": rec.index, "tool": tool, "args": args, "timeout": timeout}
        return rec, message, float(wait) + HOST_GRACE_S

    def _count(self, rec: _Record, slot: Slot, tool: str) -> None:
        """Note a call sent for ``slot``: the slot executing, its calls by tool."""
        rec.inflight += 1
        calls = slot._calls
        calls[tool] = calls.get(tool, 0) + 1
        slot.state = SlotState.EXECUTING

    def count_rate(self, n: int) -> None:
        """Count ``n`` calls sent now in the pool's statistics and call rate."""
        self.stats["calls"] += n
        tick = int(time.monotonic() * RATE_TICKS_PER_S)
        last = self._rate_window[-1] if self._rate_window else None
        if last is not None and last[0] == tick:
            last[1] += n
        else:
            self._new_rate_tick(tick)
            self._rate_window[-1][1] = n

    @staticmethod
    def call_ended(rec: _Record, slot: Slot) -> None:
        """A call :meth:`submit` sent for ``slot`` (leasing ``rec``) came back, or its
        caller stopped waiting for it: the slot is no longer executing once none is left."""
        rec.inflight -= 1
        if rec.inflight == 0 and rec.holder is slot and slot.state is SlotState.EXECUTING:
            slot.state = SlotState.ACQUIRED

    def to_result(self, slot: Slot, tool: str, outcome: Any, execution_id: str) -> ExecutionResult:
        if isinstance(outcome, BaseException):
            if isinstance(outcome, HermesModalToolError):
                msg = str(outcome)
            else:
                msg = f"{type(outcome).__name__}: {outcome}"
            self.stats["failures"] += 1
            died = isinstance(outcome, SandboxError)
            return ExecutionResult.failure(msg, slot.slot_id, "sandbox_died" if died else "lost")
        if not outcome.get("ok"):
            self.stats["failures"] += 1
            return ExecutionResult.failure(f"agent error: {outcome.get('error')}", slot.slot_id, "bad_request")
        result = ExecutionResult.from_agent(outcome["result"], slot.slot_id, execution_id, tool)
        if not result.success:
            self.stats["failures"] += 1
        if result.metadata.get("timed_out"):
            self.stats["timeouts"] += 1
        return result


def call_wait(tool: str, args: dict[str, Any], timeout: float) -> float:
    """Seconds a call may run: a ``bash`` call's own positive ``timeout`` argument (inf
    past :data:`MAX_CALL_TIMEOUT_S`, ints beyond float range too), else ``timeout``."""
    own = args.get("timeout") if tool == "bash" else None
    if isinstance(own, (int, float)) and not isinstance(own, bool) and own > 0:
        return own if own <= MAX_CALL_TIMEOUT_S else math.inf
    return timeout


def unsendable(slot: Slot, tool: str, args: dict[str, Any], exc: ProtocolError) -> ExecutionResult:
    """The failed result of a call whose arguments JSON cannot carry (``bad_request``),
    naming the arguments at fault."""
    bad = [k for k, v in args.items() if not _json_ok(v)]
    named = f"argument {', '.join(map(repr, bad))} " if bad else "arguments "
    return ExecutionResult.failure(f"{tool} {named}cannot be sent as JSON: {exc}", slot.slot_id,
                                   "bad_request")


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return False
    return True
