"""The pool's slot resets and quarantine (resets.py ``SlotResets``) in process
(milliseconds a test: the mutation script runs these against every mutant). The same
with real sandboxes, a reset made to fail from the host, is in
security/test_attack_resets.py and test_reset_reuse.py.

The sandbox here is a stand-in that answers ``reset`` as the agent's protocol does
(``{"ok": true}``, ``{"ok": false, "error": ...}``) or raises what ``Sandbox.request``
raises (``SandboxError`` on a timeout, ``SandboxDiedError``); the pool is the mixin with
the few pool methods it needs, each recording what it was asked. The verdicts: whether
the slot is offered to the next tenant, its quarantine record, the pool's counters and
error, the retries scheduled (and their delays), and retirement.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from hermes_modal_tool import resets
from hermes_modal_tool._slot_record import SlotRecord
from hermes_modal_tool.errors import SandboxDiedError, SandboxError

#: The module's own values (the fixture below shortens the delays for the other tests).
RETRY_S, TIMEOUT_S = resets.QUARANTINE_RETRY_S, resets.RESET_TIMEOUT_S


class StandInSandbox:
    """Answers each request with the next of ``answers`` (a reply dict or an exception)."""

    def __init__(self, sandbox_id: str, answers: list[Any]) -> None:
        self.sandbox_id = sandbox_id
        self.answers = list(answers)
        self.requests: list[tuple[dict, float]] = []

    async def request(self, msg: dict, timeout: float) -> dict:
        self.requests.append((msg, timeout))
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


class Pool(resets.SlotResets):
    def __init__(self) -> None:
        self._records: dict[str, list[SlotRecord]] = {}
        self._sandboxes: dict[str, StandInSandbox] = {}
        self.stats = {"quarantined": 0}
        self.last_error: str | None = None
        self.offered: list[str] = []
        self.retired: list[str] = []
        self.spawned: list[tuple[str, float, int]] = []
        self.tasks: list[asyncio.Task] = []

    def add(self, sb: StandInSandbox, n: int = 1) -> list[SlotRecord]:
        recs = [SlotRecord(sb, i, f"{sb.sandbox_id}_slot_{i}", "/ws", ready=False) for i in range(n)]
        self._records[sb.sandbox_id] = recs
        self._sandboxes[sb.sandbox_id] = sb
        return recs

    def _spawn(self, coro, name: str) -> asyncio.Task:
        args = coro.cr_frame.f_locals
        self.spawned.append((name, args["delay"], args["lease"]))
        task = asyncio.ensure_future(coro)
        self.tasks.append(task)
        return task

    def _offer(self, rec: SlotRecord) -> None:
        self.offered.append(rec.slot_id)

    def _retire(self, sb: StandInSandbox) -> None:
        self.retired.append(sb.sandbox_id)
        self._sandboxes.pop(sb.sandbox_id, None)


@pytest.fixture(autouse=True)
def quick(monkeypatch) -> None:
    monkeypatch.setattr(resets, "QUARANTINE_RETRY_S", (0.01, 0.02, 0.03))


async def settle(pool: Pool) -> None:
    while any(not t.done() for t in pool.tasks):
        await asyncio.gather(*pool.tasks)


def test_a_reset_that_succeeds_offers_the_slot() -> None:
    async def go() -> None:
        pool = Pool()
        sb = StandInSandbox("sb1", [{"ok": True}])
        [rec] = pool.add(sb)
        rec.index = 3
        await pool._reset(rec)
        assert sb.requests == [({"op": "reset", "slot": 3}, resets.RESET_TIMEOUT_S)]
        assert rec.ready is True and pool.offered == ["sb1_slot_0"]
        assert "quarantine" not in rec.extra and pool.stats["quarantined"] == 0 and pool.last_error is None
    asyncio.run(go())


@pytest.mark.parametrize("failure", [{"ok": False, "error": "could not empty the workspace"},
                                     {"error": "could not empty the workspace"},
                                     SandboxError("could not empty the workspace")])
def test_a_failed_reset_quarantines_the_slot_and_schedules_a_retry(failure, caplog) -> None:
    async def go() -> None:
        pool = Pool()
        sb = StandInSandbox("sb1", [failure, {"ok": True}])
        [rec] = pool.add(sb)
        rec.lease = 7
        with caplog.at_level(logging.WARNING, logger="hermes_modal_tool"):
            await pool._reset(rec)
            q = rec.extra["quarantine"]
            assert q == {"slot_id": "sb1_slot_0", "attempts": 1, "error": "could not empty the workspace"}
            assert pool.offered == [] and rec.ready is False  # nobody gets the unwiped slot
            assert pool.stats["quarantined"] == 1
            assert pool.last_error == "reset of sb1_slot_0 failed: could not empty the workspace"
            assert pool.spawned == [("hermes-modal-tool retry sb1_slot_0", 0.01, 7)]
            assert "quarantined (its neighbours keep running); retrying in 0.01 s" in caplog.text
            await settle(pool)  # the retry succeeds: the slot is back
        assert pool.offered == ["sb1_slot_0"] and rec.ready and "quarantine" not in rec.extra
        assert "slot sb1_slot_0 is back in service" in caplog.text and pool.retired == []
    asyncio.run(go())


def test_a_died_sandbox_is_neither_offered_nor_quarantined() -> None:
    async def go() -> None:
        pool = Pool()
        [rec] = pool.add(StandInSandbox("sb1", [SandboxDiedError("agent exited")]))
        await pool._reset(rec)
        assert pool.offered == [] and pool.spawned == [] and "quarantine" not in rec.extra
        assert pool.stats["quarantined"] == 0 and pool.last_error is None
    asyncio.run(go())


def test_retries_follow_the_delays_then_give_up_and_retire_a_sandbox_with_nothing_left(caplog) -> None:
    async def go() -> None:
        pool = Pool()
        fail = {"ok": False, "error": "stuck"}
        sb = StandInSandbox("sb1", [fail] * 4 + [fail] * 4)
        a, b = pool.add(sb, 2)
        with caplog.at_level(logging.WARNING, logger="hermes_modal_tool"):
            await pool._reset(a)
            await settle(pool)
        assert [d for _, d, _ in pool.spawned] == [0.01, 0.02, 0.03]
        q = a.extra["quarantine"]
        assert q["attempts"] == 4 and q["gave_up"] is True and pool.stats["quarantined"] == 1
        assert "reset of sb1_slot_0 failed 4 times (stuck)" in caplog.text
        assert pool.retired == []  # its neighbour still serves
        await pool._reset(b)
        await settle(pool)
        assert b.extra["quarantine"]["gave_up"] and pool.stats["quarantined"] == 2
        assert pool.retired == ["sb1"] and pool.offered == []
        assert len(sb.requests) == 8
    asyncio.run(go())


@pytest.mark.parametrize("change", ["lease", "holder", "sandbox"])
def test_a_retry_is_dropped_when_the_slot_moved_on(change) -> None:
    async def go() -> None:
        pool = Pool()
        sb = StandInSandbox("sb1", [{"ok": True}])
        [rec] = pool.add(sb)
        rec.lease = 2
        if change == "lease":
            rec.lease = 3
        elif change == "holder":
            rec.holder = object()  # type: ignore[assignment]
        else:
            pool._sandboxes.clear()
        await pool._retry_reset(rec, 2, 0.0)
        assert sb.requests == [] and pool.offered == []
        # Positive control: unchanged, the same retry resets and offers it.
        rec.lease, rec.holder = 2, None
        pool._sandboxes["sb1"] = sb
        await pool._retry_reset(rec, 2, 0.0)
        assert len(sb.requests) == 1 and pool.offered == ["sb1_slot_0"]
    asyncio.run(go())


def test_the_retry_waits_its_delay() -> None:
    async def go() -> None:
        pool = Pool()
        sb = StandInSandbox("sb1", [{"ok": True}])
        [rec] = pool.add(sb)
        task = asyncio.ensure_future(pool._retry_reset(rec, 0, 0.2))
        await asyncio.sleep(0.05)
        assert sb.requests == [] and not task.done()
        await task
        assert len(sb.requests) == 1
    asyncio.run(go())


def test_the_delays_and_the_wait_are_the_documented_ones() -> None:
    """SECURITY.md: a failed reset is "retried after 2, 10 and 30 s"; the host waits 60 s
    for the agent's answer."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "SECURITY.md").read_text()
    assert "retried after 2, 10 and 30 s" in text and "the host's 60 s wait" in text
    assert RETRY_S == (2.0, 10.0, 30.0) and TIMEOUT_S == 60.0
