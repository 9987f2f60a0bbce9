"""agent/limits/quiet.py: background work waits while the CPU is saturated, within its budget.

The pressure file is written in the kernel's own format (``Documentation/accounting/
psi.rst``); the clock is the test's, so the waits are exact and take no time."""

import os

import pytest

from hermes_modal_tool.agent.limits import quiet


class Machine:
    """A PSI file whose stall total grows at ``share`` of the time the test's clock moves."""

    def __init__(self, path, share=0.0, avg10=0.0):
        self.path = str(path)
        self.now = 100.0
        self.total = 5_000_000
        self.share = share
        self.avg10 = avg10
        self.slept = []
        self._write()

    def _write(self):
        with open(self.path, "w") as fh:
            fh.write(f"some avg10={self.avg10 * 100:.2f} avg60=0.00 avg300=0.00 total={self.total}\n"
                     "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")

    def clock(self):
        return self.now

    def sleep(self, s):
        self.slept.append(s)
        self.now += s
        self.total += int(s * 1e6 * self.share)
        self._write()

    def quiet(self, busy_here=lambda: False, budget=2.0):
        return quiet.CpuQuiet(busy_here, path=self.path, poll=0.05, budget=budget,
                              clock=self.clock, sleep=self.sleep)


def test_a_free_cpu_does_not_wait(tmp_path):
    m = Machine(tmp_path / "cpu")
    q = m.quiet()
    assert q.wait(lambda: False) is True
    assert m.slept == []
    assert q.pressure() == 0.0


def test_pressure_is_the_stall_share_since_the_last_reading(tmp_path):
    m = Machine(tmp_path / "cpu", share=0.8, avg10=0.1)
    q = m.quiet()
    assert q.pressure() == pytest.approx(0.1)  # no earlier reading: the kernel's avg10
    m.sleep(0.02)
    assert q.pressure() == pytest.approx(0.1)  # younger than poll: not read again
    m.sleep(0.2)
    assert q.pressure() == pytest.approx(0.8)
    m.sleep(5.0)  # stale: avg10 again
    assert q.pressure() == pytest.approx(0.1)


def test_a_saturated_cpu_waits_until_it_is_free(tmp_path):
    m = Machine(tmp_path / "cpu", share=0.9, avg10=0.9)
    q = m.quiet()
    frees_at = m.now + 0.5

    def sleep(s):
        Machine.sleep(m, s)
        if m.now >= frees_at:
            m.share = 0.1

    q.sleep = sleep
    assert q.wait(lambda: False) is True
    assert frees_at <= m.now < frees_at + 0.2  # one or two readings after it freed up
    assert all(s == 0.05 for s in m.slept)


def test_a_wait_ends_at_its_budget_or_when_stopped(tmp_path):
    m = Machine(tmp_path / "cpu", share=1.0, avg10=1.0)
    q = m.quiet(budget=2.0)
    start = m.now
    assert q.wait(lambda: False) is False
    assert 2.0 <= m.now - start < 2.1
    stop_at = m.now + 0.3
    assert q.wait(lambda: m.now >= stop_at) is False
    assert stop_at <= m.now < stop_at + 0.1


def test_work_queued_behind_waiting_work_waits_no_longer_than_its_budget(tmp_path):
    """On a machine that stays busy, each wait ends at its own work's budget, counted from
    when it was queued: work queued behind it does not wait a budget more each."""
    m = Machine(tmp_path / "cpu", share=1.0, avg10=1.0)
    q = m.quiet(budget=2.0)
    queued = [m.now + 0.1 * i for i in range(5)]  # five pieces, queued 0.1 s apart
    for when in queued:
        q.wait(lambda: False, since=when)
    assert queued[-1] + 2.0 <= m.now < queued[-1] + 2.1  # not 5 x 2 s


def test_the_agents_own_waiting_starts_count_without_psi(tmp_path):
    """No PSI (gVisor, psi=0): only the agent's own signal; the path is not read again."""
    m = Machine(tmp_path / "cpu")
    waiting = [3]

    def busy_here():
        waiting[0] -= 1
        return waiting[0] > 0

    q = quiet.CpuQuiet(busy_here, path=str(tmp_path / "none"), poll=0.05, budget=2.0,
                       clock=m.clock, sleep=m.sleep)
    assert q.wait(lambda: False) is True
    assert m.slept == [0.05, 0.05]
    assert q.pressure() is None and q.path is None


def test_a_malformed_pressure_file_counts_as_none(tmp_path):
    bad = tmp_path / "cpu"
    bad.write_text("some avg10=x total=y\n")
    q = quiet.CpuQuiet(lambda: False, path=str(bad))
    assert q.pressure() is None
    assert q.wait(lambda: False) is True


def test_this_machines_pressure_reads_as_a_share_or_none():
    q = quiet.CpuQuiet(lambda: False)
    first = q.pressure()
    q.sleep(0.06)
    second = q.pressure()
    if not os.path.exists(quiet.PRESSURE):  # a kernel without PSI
        assert first is None and second is None
    else:
        assert 0.0 <= first <= 1.0 and 0.0 <= second <= 1.0
