"""Admission control (agent/limits/admission.py ``Admission``) in process, on a clock the
test moves (milliseconds a test: the mutation script runs these against every mutant; the
same gate with real sandboxes and real CPU hogs is in test_admission.py).

The verdicts are what the gate decides: who counts, who waits, in which order a queue is
admitted, when a sampled command stops counting, and the weight it reports; each refusal
sits beside the admission that the same state allows a moment later.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from hermes_modal_tool.agent.limits import admission as adm
from hermes_modal_tool.agent.limits.admission import (
    FIRST_CHECK_S,
    HEAD_START_CPU_S,
    HEAD_START_S,
    MAX_CHECK_S,
    YOUNG_WEIGHT,
    Admission,
)


class Clock:
    """``time.monotonic`` of the module under test, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class Loop:
    """What the gate uses of its event loop: ``time()`` and ``call_at`` (timers recorded,
    run by the test with :meth:`fire`)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.timers: list[Timer] = []

    def time(self) -> float:
        return self.clock.now

    def call_at(self, when: float, fn) -> Timer:
        timer = Timer(when, fn)
        self.timers.append(timer)
        return timer

    def pending(self) -> list[Timer]:
        return [t for t in self.timers if not t.cancelled]


class Timer:
    def __init__(self, when: float, fn) -> None:
        self._when, self.fn, self.cancelled = when, fn, False

    def when(self) -> float:
        return self._when

    def cancel(self) -> None:
        self.cancelled = True


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(adm, "time", c)
    return c


def gate(clock: Clock, limit: float = 1) -> Admission:
    return Admission(Loop(clock), limit)


def computes(cpu: list[float] | None = None):
    """A probe of a command that wants CPU; ``cpu[0]`` is its CPU-time counter."""
    cpu = cpu if cpu is not None else [0.0]
    return lambda: (True, cpu[0])


def test_young_commands_weigh_an_eighth_until_their_first_check(clock) -> None:
    g = gate(clock, limit=1)
    assert [g.try_admit(f"s{i}", computes()) for i in range(9)] == [True] * 8 + [False]
    assert g.load() == pytest.approx(1.0) and len(g.counted) == 8
    clock.now += FIRST_CHECK_S - 0.001
    assert g.load() == pytest.approx(1.0)  # still young
    clock.now += 0.001
    assert g.load() == pytest.approx(8.0)  # aged: each weighs 1
    assert g.statistics() == {"limit": 1, "load": pytest.approx(8.0), "counted": 8, "waiting": 0,
                              "admitted": 8, "queued": 0}
    for i in range(7):
        g.release(f"s{i}")
    assert g.load() == pytest.approx(1.0) and not g.try_admit("late", computes())
    g.release("s7")
    assert g.load() == 0 and g.try_admit("late", computes())  # room again
    assert g.load() == pytest.approx(YOUNG_WEIGHT)


def test_a_larger_limit_admits_more(clock) -> None:
    g = gate(clock, limit=2)
    assert sum(g.try_admit(f"s{i}", computes()) for i in range(20)) == 16


def test_the_queue_is_first_come_first_served_and_blocks_newcomers(clock) -> None:
    g = gate(clock, limit=YOUNG_WEIGHT)
    started: list[str] = []
    assert g.try_admit("a", computes())
    g.enqueue("b", computes(), lambda: started.append("b"))
    g.enqueue("c", computes(), lambda: started.append("c"))
    assert started == [] and list(g.waiting) == ["b", "c"] and g.queued == 2
    assert not g.try_admit("d", computes())  # others wait: no jumping the queue
    g.release("a")
    assert started == ["b"] and list(g.waiting) == ["c"] and "b" in g.counted
    assert g.admitted == 2
    g.release("b")
    assert started == ["b", "c"] and not g.waiting
    g.release("c")
    assert g.try_admit("d", computes())


def test_enqueue_with_room_admits_at_once(clock) -> None:
    g = gate(clock, limit=1)
    started: list[str] = []
    g.enqueue("a", computes(), lambda: started.append("a"))
    assert started == ["a"] and "a" in g.counted and not g.waiting
    assert g.loop.pending() == []  # nobody waits: no sampling timer


def test_a_release_admits_as_many_as_fit(clock) -> None:
    g = gate(clock, limit=1)
    for i in range(8):
        assert g.try_admit(f"s{i}", computes())
    started: list[str] = []
    for k in "abc":
        g.enqueue(k, computes(), lambda k=k: started.append(k))
    assert started == []
    g.release("s0")
    g.release("s1")
    assert started == ["a", "b"] and list(g.waiting) == ["c"]


def test_a_hold_weighs_one_is_never_sampled_and_its_release_admits(clock) -> None:
    g = gate(clock, limit=1)
    g.hold("shell")
    assert g.load() == 1.0 and not g.try_admit("a", computes())
    started: list[str] = []
    g.enqueue("a", computes(), lambda: started.append("a"))
    assert g.loop.pending() == []  # only a hold counts: nothing to sample
    clock.now += 100
    assert g.load() == 1.0 and started == []
    g.release("shell")
    assert started == ["a"]


def test_discard_forgets_a_waiting_or_counted_key(clock) -> None:
    g = gate(clock, limit=YOUNG_WEIGHT)
    started: list[str] = []
    assert g.try_admit("a", computes())
    g.enqueue("b", computes(), lambda: started.append("b"))
    g.enqueue("c", computes(), lambda: started.append("c"))
    g.discard("b")
    assert list(g.waiting) == ["c"] and started == []
    g.discard("a")
    assert started == ["c"] and "a" not in g.counted
    g.release("never-counted")  # no error, nothing admitted twice
    assert started == ["c"]


def test_a_sample_that_finds_a_command_waiting_makes_room(clock) -> None:
    g = gate(clock, limit=1)
    busy = [True]
    assert g.try_admit("sleeper", lambda: (busy[0], 0.0))
    clock.now += FIRST_CHECK_S
    started: list[str] = []
    g.enqueue("next", computes(), lambda: started.append("next"))
    assert started == [] and len(g.loop.pending()) == 1
    [timer] = g.loop.pending()
    assert timer.when() == pytest.approx(clock.now + FIRST_CHECK_S / 2)  # due already: soon
    g._tick()
    assert started == [] and "sleeper" in g.counted  # it still computes
    busy[0] = False
    clock.now += 1
    g._tick()
    assert started == ["next"] and "sleeper" not in g.counted


def test_a_command_stops_counting_after_its_cpu_head_start(clock) -> None:
    g = gate(clock, limit=1)
    cpu = [5.0]  # CPU used before its first sample does not count
    assert g.try_admit("hog", computes(cpu))
    g.enqueue("next", computes(), lambda: None)
    clock.now += FIRST_CHECK_S
    g._tick()
    entry = g.counted["hog"]
    assert entry[5] == 5.0 and entry[3] == 2 * FIRST_CHECK_S
    assert entry[2] == pytest.approx(clock.now + 2 * FIRST_CHECK_S)
    cpu[0] = 5.0 + HEAD_START_CPU_S - 0.01
    clock.now = entry[2]
    g._tick()
    assert "hog" in g.counted and entry[3] == 4 * FIRST_CHECK_S
    cpu[0] = 5.0 + HEAD_START_CPU_S
    clock.now = entry[2]
    g._tick()
    assert "hog" not in g.counted and "next" in g.counted


def test_sampling_intervals_double_up_to_the_most_and_stop_at_the_head_start(clock) -> None:
    g = gate(clock, limit=1)
    assert g.try_admit("hog", computes())
    admitted = clock.now
    g.enqueue("next", computes(), lambda: None)
    entry = g.counted["hog"]
    seen = []
    while "hog" in g.counted and len(seen) < 200:
        clock.now = entry[2]
        g._tick()
        seen.append(entry[3])
    assert seen[:5] == pytest.approx([0.04, 0.08, 0.16, 0.32, MAX_CHECK_S])
    assert max(seen) == MAX_CHECK_S
    assert "hog" not in g.counted and clock.now - admitted == pytest.approx(HEAD_START_S)


def test_a_sample_not_due_is_not_taken(clock) -> None:
    g = gate(clock, limit=1)
    calls = []
    assert g.try_admit("a", lambda: calls.append(1) or (False, 0.0))
    g.enqueue("next", computes(), lambda: None)
    clock.now += FIRST_CHECK_S / 4  # not due: its first sample is at FIRST_CHECK_S
    g._tick()
    assert calls == [] and "a" in g.counted
    clock.now += FIRST_CHECK_S / 2  # due within the wake-up's slack
    g._tick()
    assert calls == [1] and "a" not in g.counted


def test_a_probe_that_fails_or_a_callback_that_raises_never_sticks_the_queue(clock, capsys) -> None:
    g = gate(clock, limit=1)

    def broken():
        raise OSError("gone")

    assert g.try_admit("a", broken)
    started: list[str] = []

    def explode():
        raise RuntimeError("boom")

    clock.now += FIRST_CHECK_S  # "a" counts fully: the sandbox is full
    g.enqueue("bad", computes(), explode)
    g.enqueue("good", computes(), lambda: started.append("good"))
    assert started == [] and "a" in g.counted
    g._tick()  # "a" cannot be sampled: it stops counting
    assert "a" not in g.counted and "bad" not in g.counted and started == ["good"]
    assert "good" in g.counted and not g.waiting
    assert "admission callback failed: RuntimeError('boom')" in capsys.readouterr().err


def test_reentrant_admission_from_a_callback(clock) -> None:
    g = gate(clock, limit=YOUNG_WEIGHT)
    started: list[str] = []
    assert g.try_admit("a", computes())

    def b_done():  # finishes at once: releases itself inside its own admission
        started.append("b")
        g.release("b")

    g.enqueue("b", computes(), b_done)
    g.enqueue("c", computes(), lambda: started.append("c"))
    g.release("a")
    assert started == ["b", "c"] and not g.waiting


def test_close_cancels_the_timer_and_forgets_everything(clock) -> None:
    g = gate(clock, limit=YOUNG_WEIGHT)
    assert g.try_admit("a", computes())
    g.enqueue("b", computes(), lambda: None)
    [timer] = g.loop.pending()
    g.close()
    assert timer.cancelled and g.timer is None and not g.waiting and not g.counted
    assert g.load() == 0 and g.n_young == 0


def test_new_admissions_bring_a_late_sampling_timer_forward(clock) -> None:
    g = gate(clock, limit=2)
    assert g.try_admit("hog", computes()) and g.try_admit("y", computes())
    clock.now += FIRST_CHECK_S  # both count fully now: the sandbox is full
    for i in range(10):
        g.enqueue(f"w{i}", computes(), lambda: None)
    assert len(g.waiting) == 10
    for _ in range(5):  # sampled (both still compute) until the next sample is far off
        clock.now = g.timer.when()
        g._tick()
    late = g.timer
    assert late.when() - clock.now >= 0.1, late.when() - clock.now
    g.release("y")  # room for eight young ones; two still wait
    assert len(g.waiting) == 2 and len(g.counted) == 9
    # The new ones are due for their first sample soon: the timer comes forward to it.
    assert g.timer.when() == pytest.approx(clock.now + FIRST_CHECK_S)
    assert late.cancelled and g.timer is not late


def test_a_gate_with_no_room_at_all_still_wakes_up_to_try(clock) -> None:
    g = gate(clock, limit=YOUNG_WEIGHT / 2)  # not even a young command fits
    started: list[str] = []
    g.enqueue("a", computes(), lambda: started.append("a"))
    assert started == [] and not g.counted
    [timer] = g.loop.pending()  # nothing counted to sample: it tries again a check later
    assert timer.when() == pytest.approx(clock.now + FIRST_CHECK_S)


def fire_due(g: Admission, now: float) -> None:
    for t in g.loop.pending():
        if t.when() <= now and not t.cancelled:
            t.cancelled = True
            t.fn()


def test_one_wake_up_samples_every_due_command_past_holds_and_drops(clock) -> None:
    g = gate(clock, limit=10)
    g.hold("shell")  # first in the table: never due
    assert g.try_admit("old", computes())
    clock.now += HEAD_START_S  # "old" has had its whole head start in wall time
    g._count("idle1", lambda: (False, 0.0), clock.now)
    g._count("idle2", lambda: (False, 0.0), clock.now)
    g._count("busy", computes(), clock.now)
    clock.now += FIRST_CHECK_S
    g._tick()
    assert sorted(g.counted) == ["busy", "shell"]


def test_a_long_queue_of_calls_that_end_at_once_is_admitted_without_recursion(clock, capsys) -> None:
    g = gate(clock, limit=YOUNG_WEIGHT)
    assert g.try_admit("first", computes())
    started: list[int] = []

    def done(i: int) -> None:  # the call ends inside its own admission
        started.append(i)
        g.release(i)

    for i in range(3000):
        g.enqueue(i, computes(), lambda i=i: done(i))
    g.release("first")
    assert started == list(range(3000)) and not g.waiting and not g.counted
    assert capsys.readouterr().err == ""  # no callback failed (a RecursionError would)


def test_weights_add_up_after_holds_and_early_releases(clock) -> None:
    g = gate(clock, limit=1)
    g.hold("shell")
    g.release("shell")
    assert g.try_admit("young", computes())
    g.release("young")  # released while young
    clock.now += FIRST_CHECK_S  # its place in the ageing queue comes up
    assert g.load() == 0 and g.n_young == 0
    assert sum(g.try_admit(f"s{i}", computes()) for i in range(9)) == 8


def test_a_scheduled_sample_still_runs_after_the_queue_empties(clock) -> None:
    g = gate(clock, limit=2)
    busy = [True]
    assert g.try_admit("hog", lambda: (busy[0], 0.0)) and g.try_admit("x", computes())
    clock.now += FIRST_CHECK_S
    g.enqueue("w", computes(), lambda: None)
    for _ in range(5):  # the loop runs each timer once
        clock.now = g.timer.when()
        fire_due(g, clock.now)
    assert g.timer.when() - clock.now >= 0.1
    g.release("x")  # "w" is admitted: nobody waits now
    assert not g.waiting and "w" in g.counted
    busy[0] = False  # the hog now waits on something
    clock.now += MAX_CHECK_S
    fire_due(g, clock.now)
    assert "hog" not in g.counted, sorted(g.counted)


def test_default_limit_without_sched_getaffinity_uses_the_cpu_count(monkeypatch) -> None:
    monkeypatch.setattr(adm.os, "cpu_count", lambda: 3)

    def refuse(pid):
        raise OSError("not here")

    monkeypatch.setattr(adm.os, "sched_getaffinity", refuse)
    assert adm.default_limit() == 12
    monkeypatch.delattr(adm.os, "sched_getaffinity")  # not on this platform
    assert adm.default_limit() == 12
    monkeypatch.setattr(adm.os, "cpu_count", lambda: None)
    assert adm.default_limit() == 4


def test_default_limit_follows_the_cpus(monkeypatch) -> None:
    monkeypatch.setattr(adm.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert adm.default_limit() == 12
    assert adm.default_limit(cpu=1.5) == 6
    assert adm.default_limit(cpu=0.25) == 4  # at least MIN_LIMIT
    assert adm.default_limit(cpu=8) == 12  # no more than the CPUs there are
    assert adm.default_limit(cpu=2.1) == math.ceil(4 * 2.1)


def test_the_module_example_holds() -> None:
    loop = asyncio.new_event_loop()
    try:
        g = Admission(loop, limit=1)
        assert sum(g.try_admit(f"slot-{i}", lambda: (True, 0.0)) for i in range(10)) == 8
        started: list[str] = []
        g.enqueue("slot-10", lambda: (True, 0.0), lambda: started.append("slot-10"))
        g.release("slot-0")
        assert started == ["slot-10"]
        g.close()
    finally:
        loop.close()
