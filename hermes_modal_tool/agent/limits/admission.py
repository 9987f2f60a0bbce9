"""Admission control: how many commands of one sandbox may be starting at once.

Stdlib-only, Python 3.8.

Past a machine's capacity (1,000 slots on 2 cores), starting every command at once
makes each one wait for CPU, and timeouts expire while commands wait. So the agent
lets the commands of a sandbox weigh at most ``limit`` and queues the others, first
come first served, before their timeout clock starts (a call is admitted once its
slot's shell is ready). A command weighs from its admission until the first of:

- it ends;
- it is seen waiting: none of its processes is runnable (``sleep``, a pipe, the
  network), so N slots running ``sleep 1`` still overlap;
- it has used :data:`HEAD_START_CPU_S` seconds of CPU since it was first sampled (or
  weighed for :data:`HEAD_START_S` seconds), so long computations do not hold the
  queue up for longer than their head start; on a starved machine that head start
  lasts longer, in wall time, which keeps further commands out.

A shell that is starting (:meth:`Admission.hold`) weighs 1 until it is ready, so a
sandbox whose slots start their shells (a burst of first commands) starts them before
it lets more commands in.

A command weighs :data:`YOUNG_WEIGHT` for its first :data:`FIRST_CHECK_S` seconds and
1 after that (until a sample finds it waiting). Most commands end within that time, so
short commands are not serialized: up to ``limit / YOUNG_WEIGHT`` start at once on an
idle sandbox, and as many for each unit of weight that frees up on a busy one; should
they all compute, the sandbox briefly weighs more than ``limit`` and admits nothing
until it is back under it.

The commands are sampled only while a call waits, and each one less and less often
(:data:`FIRST_CHECK_S` after admission, then at doubling intervals up to
:data:`MAX_CHECK_S`: a command that waits is seen at once, one that computes costs a
few samples a second), so an agent with room to spare pays nothing for this.

Example:
    >>> import asyncio
    >>> loop = asyncio.new_event_loop()
    >>> gate = Admission(loop, limit=1)
    >>> computes = lambda: (True, 0.0)
    >>> sum(gate.try_admit("slot-%d" % i, computes) for i in range(10))  # 8 young ones fit
    8
    >>> started = []
    >>> gate.enqueue("slot-10", computes, lambda: started.append("slot-10"))
    >>> gate.release("slot-0")
    >>> started
    ['slot-10']
    >>> loop.close()
"""

import collections
import math
import os
import sys
import time

#: Seconds a command weighs :data:`YOUNG_WEIGHT` before it counts fully; when it is
#: first sampled (then 2x, 4x, ... later).
FIRST_CHECK_S = 0.02
YOUNG_WEIGHT = 1 / 8
#: Seconds between samples of a command at most.
MAX_CHECK_S = 0.5
#: CPU seconds a command may use while it weighs, and wall-clock seconds at most.
HEAD_START_CPU_S = 1.0
HEAD_START_S = 30.0
#: Full-weight commands per CPU of the sandbox, and at least this many.
PER_CPU = 4
MIN_LIMIT = 4


def default_limit(cpu=None):
    """The admission limit for a sandbox with ``cpu`` cores (default: the CPUs we may use)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    if cpu:
        cpus = min(cpus, float(cpu))
    return max(MIN_LIMIT, int(math.ceil(PER_CPU * cpus)))


class Admission:
    """Counts the commands starting in one sandbox and queues the rest.

    Keys are the agent's slots (one call at a time per slot). ``probe()`` returns
    ``(wants_cpu, cpu_seconds)`` of an admitted command: whether it still wants CPU, and
    a CPU-time counter that grows with what it used.

    Args:
        loop: the agent's event loop (for the sampling timer).
        limit: the most the admitted commands may weigh together.
    """

    def __init__(self, loop, limit):
        self.loop = loop
        self.limit = limit
        self.counted = {}  # key -> [admitted at, probe, next sample at, interval, young, cpu]
        self.young = collections.deque()  # entries in admission order, to age them
        self.n_young = 0  # entries of self.counted still young
        self.waiting = collections.OrderedDict()  # key -> (on_admit, probe)
        self.timer = None
        self.admitted = self.queued = 0
        self._admitting = False

    def try_admit(self, key, probe):
        """Count ``key`` now and return True, or return False (full, or others wait)."""
        now = time.monotonic()
        if self.waiting or self.load(now) + YOUNG_WEIGHT > self.limit:
            return False
        self._count(key, probe, now)
        return True

    def enqueue(self, key, probe, on_admit):
        """Queue ``key``; ``on_admit()`` runs (on the loop) once it counts.

        Behind others it cannot count yet: while calls wait there is no room (each
        admission pass admits until there is none, and room only opens by a release or
        a sample, which admit again), so only the first in the queue tries."""
        waiting = self.waiting
        waiting[key] = (on_admit, probe)
        self.queued += 1
        if len(waiting) == 1:
            self._admit()
        if waiting and self.timer is None:
            self._schedule()

    def hold(self, key):
        """Count ``key`` with weight 1 until :meth:`release` (for work that is not a
        command, such as a starting shell); it is never sampled, nor admitted by turn."""
        self._drop(key)
        self.counted[key] = [time.monotonic(), None, math.inf, 0.0, False, None]

    def discard(self, key):
        """Forget ``key`` (waiting or counted), e.g. when its call is cancelled."""
        self.waiting.pop(key, None)
        self.release(key)

    def release(self, key):
        """``key``'s command ended (or no longer counts): admit whoever waits next."""
        if self._drop(key) and self.waiting:
            self._admit()

    def load(self, now=None):
        """What the admitted commands weigh now."""
        young = self.young
        if young:
            old = (time.monotonic() if now is None else now) - FIRST_CHECK_S
            while young and young[0][0] <= old:
                entry = young.popleft()
                if entry[4]:
                    entry[4] = False
                    self.n_young -= 1
        return len(self.counted) - self.n_young * (1.0 - YOUNG_WEIGHT)

    def statistics(self):
        """Counters for ``status``: the limit, the load, admitted and waiting commands now,
        admitted and queued calls so far."""
        return {"limit": self.limit, "load": self.load(), "counted": len(self.counted),
                "waiting": len(self.waiting), "admitted": self.admitted, "queued": self.queued}

    def close(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.waiting.clear()
        self.counted.clear()
        self.young.clear()
        self.n_young = 0

    # -- internals ---------------------------------------------------------------------
    def _count(self, key, probe, now):
        self._drop(key)
        entry = [now, probe, now + FIRST_CHECK_S, FIRST_CHECK_S, True, None]
        self.counted[key] = entry
        self.young.append(entry)
        self.n_young += 1
        self.admitted += 1
        if self.waiting and (self.timer is None or self.timer.when() > now + 2 * FIRST_CHECK_S):
            self._schedule()

    def _drop(self, key):
        entry = self.counted.pop(key, None)
        if entry is None:
            return False
        if entry[4]:
            entry[4] = False  # its place in self.young is skipped when it ages
            self.n_young -= 1
        return True

    def _admit(self):
        if self._admitting:
            return  # re-entered from an on_admit that finished at once; the loop below goes on
        self._admitting = True
        try:
            now = time.monotonic()
            while self.waiting:
                room = int((self.limit - self.load(now)) / YOUNG_WEIGHT + 1e-9)
                if room <= 0:
                    break
                for _ in range(min(room, len(self.waiting))):
                    key, (on_admit, probe) = self.waiting.popitem(last=False)
                    self._count(key, probe, now)
                    try:
                        on_admit()
                    except Exception as exc:  # noqa: BLE001 - never leave the queue stuck
                        sys.stderr.write("hermes-modal-tool agent: admission callback failed: %r\n"
                                         % (exc,))
                        self._drop(key)
        finally:
            self._admitting = False

    def _schedule(self):
        """Wake up for the next sample while a call waits."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.waiting:
            return
        when = min([e[2] for e in self.counted.values()] or [time.monotonic() + FIRST_CHECK_S])
        if when == math.inf:
            return  # only holds: their release admits the next
        self.timer = self.loop.call_at(max(when, self.loop.time() + FIRST_CHECK_S / 2), self._tick)

    def _tick(self):
        self.timer = None
        now = time.monotonic()
        self.load(now)  # age the young ones
        soon = now + FIRST_CHECK_S / 2  # one wake-up samples everything due about now
        for key, entry in list(self.counted.items()):
            if entry[2] > soon:
                continue  # not due yet, or a hold
            if now - entry[0] >= HEAD_START_S:
                self._drop(key)
                continue
            try:
                busy, cpu = entry[1]()
            except Exception:  # noqa: BLE001 - cannot tell: do not hold the queue up
                busy, cpu = False, 0.0
            if entry[5] is None:
                entry[5] = cpu  # the CPU time used before the first sample is not counted
            if not busy or cpu - entry[5] >= HEAD_START_CPU_S:
                self._drop(key)
                continue
            entry[3] = min(2 * entry[3], MAX_CHECK_S)
            entry[2] = min(now + entry[3], entry[0] + HEAD_START_S)
        self._admit()
        self._schedule()
