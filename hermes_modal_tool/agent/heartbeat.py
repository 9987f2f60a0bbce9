"""The owner's heartbeat, as the agent passes it on to the sandbox's watchdog.

On Modal, the sandbox's entrypoint (``WATCHDOG_SH`` in ``drivers/modal.py``) ends the
sandbox when its heartbeat file has not been marked for ``heartbeat_timeout`` seconds.
The owner sends a ``ping`` frame every sixth of that; the agent notes that it heard
from the owner (any frame counts) and, on a timer, marks the file if it did. When the
owner dies (even with ``kill -9``, which Modal's exec stream does not report to the
agent), nothing marks the file and the sandbox ends within the timeout: no orphans
without anyone running ``modal gc``.
"""

import os


class Heartbeat:
    """Marks ``path`` every ``every`` seconds while frames keep arriving.

    Args:
        loop: the agent's event loop.
        path: the watchdog's file (root's, in a 0700 directory).
        every: seconds between marks (the owner pings as often).
    """

    def __init__(self, loop, path, every):
        self.loop = loop
        self.path = path
        self.every = max(0.5, float(every))
        self.heard = True
        self.timer = loop.call_later(self.every, self.tick)

    def tick(self):
        if self.heard:
            self.heard = False
            try:
                os.utime(self.path)  # one syscall, never blocks on a slot's doing
            except OSError:
                pass
        self.timer = self.loop.call_later(self.every, self.tick)

    def stop(self):
        self.timer.cancel()
