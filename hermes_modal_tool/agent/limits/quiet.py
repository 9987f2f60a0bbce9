"""Waiting for the CPU to be free before background work that nothing waits for yet.

Stdlib-only, Python 3.8.

A slot's standby layer (the next tenant's root, :meth:`.rootfs.SlotRoot.prepare_standby`)
and its root view for forks are needed at the slot's reset or fork, not before. Made as
soon as the slot's first shell has started, they take about 1 ms of worker-thread CPU a
slot (``mkdir``, ``mount``) from the shells that callers wait for: when 1,000 fresh slots
start at once every core is busy starting shells, and this work only delays them.

So such work waits while the CPU is saturated: Linux's pressure stall information
(``/proc/pressure/cpu``, its ``some`` line: the share of wall time in which at least one
runnable task waited for a CPU) at :data:`BUSY` or more over the last :data:`POLL_S` or
longer, or the agent's own shells waiting to start. It waits at most :data:`BUDGET_S`
per wait, so work is never put off for good on a machine that stays busy; a reset that
comes first builds its layer itself, as without a standby. Where the kernel has no PSI
(gVisor, a kernel before 4.20 or booted with ``psi=0``) the agent's own signal alone
counts.
"""

import time

PRESSURE = "/proc/pressure/cpu"
#: Share of time (0-1) with a task waiting for a CPU at which the CPU counts as saturated.
BUSY = 0.5
#: Seconds between readings of the pressure (and the shortest span one is measured over).
POLL_S = 0.05
#: Longest a wait lasts (seconds): then the work is done anyway.
BUDGET_S = 10.0
#: After a reading older than this (seconds), the kernel's 10-second average is used.
STALE_S = 1.0


class CpuQuiet:
    """Waits until the CPU is not saturated; for one worker thread (it is not locked).

    ``busy_here()``: whether the agent's own work waits now (read from a worker thread:
    a plain flag or count of the event loop's). ``path``, ``busy``, ``poll``, ``budget``:
    see the module's constants; ``clock``/``sleep`` are :mod:`time`'s unless given."""

    def __init__(self, busy_here, path=PRESSURE, busy=BUSY, poll=POLL_S, budget=BUDGET_S,
                 clock=time.monotonic, sleep=time.sleep):
        self.busy_here = busy_here
        self.path = path
        self.busy = busy
        self.poll = poll
        self.budget = budget
        self.clock = clock
        self.sleep = sleep
        self._last = None  # (when, stall total in µs) of the last reading
        self._share = 0.0  # the pressure measured up to it

    def _read(self):
        """The ``some`` line: ``(avg10 as a share, total µs of stall since boot)``; None
        without PSI (then ``path`` is dropped: it is not read again)."""
        if self.path is None:
            return None
        try:
            with open(self.path, "rb") as fh:
                fields = dict(f.split(b"=", 1) for f in fh.readline().split()[1:])
            return float(fields[b"avg10"]) / 100, int(fields[b"total"])
        except (OSError, KeyError, ValueError):
            self.path = None
            return None

    def pressure(self):
        """The share of time (0-1) some task waited for a CPU since the last reading, or
        None without PSI. A reading younger than ``poll`` seconds is not repeated (its
        value is returned); after one older than :data:`STALE_S`, the kernel's own
        10-second average is the answer."""
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.poll:
            return self._share
        reading = self._read()
        if reading is None:
            return None
        avg10, total = reading
        if self._last is None or now - self._last[0] > STALE_S:
            self._share = avg10
        else:
            then, before = self._last
            self._share = (total - before) / 1e6 / (now - then)
        self._last = (now, total)
        return self._share

    def saturated(self):
        """Whether work that can wait should wait now."""
        if self.busy_here():
            return True
        share = self.pressure()
        return share is not None and share >= self.busy

    def wait(self, stop, since=None):
        """Block until the CPU is not saturated, ``stop()`` is true, or ``budget`` seconds
        have passed since ``since`` (a reading of ``clock``: when the work was queued, so
        that work queued behind other waiting work does not wait longer; default now).
        Returns True when the CPU was found free."""
        deadline = (self.clock() if since is None else since) + self.budget
        while self.saturated():
            if self.clock() >= deadline or stop():
                return False
            self.sleep(self.poll)
        return True
