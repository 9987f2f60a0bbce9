"""Many deadlines on one event-loop timer.

Stdlib-only, Python 3.8: the in-sandbox agent uses it for its commands' timeouts, the
host for its requests' deadlines.

Each call and each request has a deadline that almost never passes: it is set when the
call starts and dropped when it ends, a fraction of a millisecond later. An asyncio
timer per deadline (``loop.call_later`` and ``TimerHandle.cancel``) costs a
``TimerHandle``, a push onto the loop's heap with a Python ``__lt__`` per comparison,
and a pass over the cancelled handles later: about 3 µs per call, of the 60 µs the
agent spends on a trivial one. Here a deadline is a short list on a heap of our own
(compared in C), dropping one marks it, and one loop timer waits for the earliest live
deadline; marked entries are thrown away when they reach the top, or all at once when
they outnumber the live ones.

Example:
    >>> import asyncio
    >>> loop = asyncio.new_event_loop()
    >>> fired = []
    >>> deadlines = Deadlines(loop)
    >>> soon = deadlines.add(0.01, fired.append, "soon")
    >>> later = deadlines.add(0.02, fired.append, "later")
    >>> deadlines.drop(later)
    >>> loop.run_until_complete(asyncio.sleep(0.05))
    >>> fired
    ['soon']
    >>> loop.close()
"""

import heapq
import itertools
import math

#: Marked entries the heap may hold before it is rebuilt without them (and at least as
#: many as the live ones), so a million dropped deadlines never pile up.
COMPACT_AT = 256


class Deadlines:
    """Callbacks due after a delay, on one loop timer (see the module docstring).

    Args:
        loop: the event loop the callbacks run on (they run from its timer).
    """

    __slots__ = ("loop", "_heap", "_seq", "_timer", "_timer_at", "_dropped")

    def __init__(self, loop):
        self.loop = loop
        self._heap = []  # [when, seq, callback, arg]; callback None once dropped
        self._seq = itertools.count()
        self._timer = None
        self._timer_at = math.inf
        self._dropped = 0

    def __len__(self):
        """How many deadlines are live (added, not dropped, not yet due)."""
        return len(self._heap) - self._dropped

    def add(self, delay, callback, arg):
        """Call ``callback(arg)`` on the loop ``delay`` seconds from now (loop time),
        unless :meth:`drop` gets the returned entry first."""
        when = self.loop.time() + delay
        entry = [when, next(self._seq), callback, arg]
        heapq.heappush(self._heap, entry)
        if when < self._timer_at:
            self._arm(when)
        return entry

    def drop(self, entry):
        """Forget ``entry`` (from :meth:`add`): its callback will not run. Dropping an
        entry that was dropped or is due already does nothing."""
        if entry[2] is None:
            return
        entry[2] = entry[3] = None
        self._dropped += 1
        if self._dropped > COMPACT_AT and self._dropped * 2 > len(self._heap):
            self._heap = [e for e in self._heap if e[2] is not None]
            heapq.heapify(self._heap)
            self._dropped = 0

    def close(self):
        """Drop every deadline and the loop timer."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_at = math.inf
        for entry in self._heap:
            entry[2] = entry[3] = None
        self._heap = []
        self._dropped = 0

    def _arm(self, when):
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_at(when, self._fire)
        self._timer_at = when

    def _fire(self):
        self._timer = None
        self._timer_at = math.inf
        heap = self._heap
        now = self.loop.time()
        due = []
        while heap and (heap[0][2] is None or heap[0][0] <= now):
            entry = heapq.heappop(heap)
            if entry[2] is None:
                self._dropped -= 1
            else:
                due.append((entry[2], entry[3]))
                entry[2] = entry[3] = None
        if heap:
            self._arm(heap[0][0])
        for callback, arg in due:
            try:
                callback(arg)
            except Exception as exc:  # noqa: BLE001 - the other due callbacks still run
                self.loop.call_exception_handler({
                    "message": "a deadline's callback failed", "exception": exc})
