"""A transfer's SHA-256, computed in a thread of its own beside the thread that reads or
writes the file (both ends of a streamed transfer use it: the agent's upload and download
streams, ``streamin.py``/``streamout.py``, and the host's, ``hermes_modal_tool/filetransfer.py``).

Reading or writing a chunk and hashing it were one thread's work, one after the other:
that thread was the slowest stage of a transfer (1.35-1.5 ms of CPU per MiB on the shared
2-core machine, where the loops that move the frames spent 0.6-1.0), so on a machine with
a core for each stage it bounded the transfer at about 700 MiB/s. Apart, each is about
half of that; ``hashlib`` and the system calls let go of the GIL, so the two run at once.
Apart they also cost more CPU in all (about 0.6-0.9 ms per MiB more on that machine: the
hand-offs, and the chunk read again from another core's cache), which a machine with few
cores pays in speed: :func:`hasher` hashes in a thread of its own only where this process
may run on :data:`MIN_CORES` cores or more, unless told.

Stdlib-only, Python 3.8.
"""

import hashlib
import os
import queue
import threading

#: Chunks handed over and not hashed yet, at most (the thread that hands them waits):
#: the memory a hash thread holds besides its transfer's own window.
AHEAD = 8
#: Cores this process may run on from which a transfer hashes in a thread of its own.
MIN_CORES = 4


def hasher(digest=None, own_thread=None, name="hermes-modal-tool-sha256"):
    """A transfer's SHA-256 (``update``, ``hexdigest``, ``close``), continuing ``digest``:
    a :class:`HashThread` when ``own_thread`` (None: when this process may run on
    :data:`MIN_CORES` cores or more), else computed in the caller's thread."""
    if own_thread is None:
        own_thread = cores() >= MIN_CORES
    return HashThread(digest, name) if own_thread else Inline(digest)


def cores():
    """Cores this process may run on (its affinity; the machine's where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class Inline:
    """:class:`HashThread`'s interface, hashed in the caller's thread."""

    def __init__(self, digest=None):
        self.digest = digest if digest is not None else hashlib.sha256()

    def update(self, blob):
        self.digest.update(blob)

    def hexdigest(self):
        return self.digest.hexdigest()

    def close(self):
        pass


class HashThread:
    """A SHA-256 like ``hashlib``'s (``update``, ``hexdigest``), fed from one thread and
    computed in another. ``digest`` continues a hash already started (a resume's first
    bytes). :meth:`hexdigest` waits for what was handed over and ends the thread;
    :meth:`close` ends it without waiting (a transfer that stops early). Each chunk is
    kept (not copied) until hashed: the caller must not change it."""

    def __init__(self, digest=None, name="hermes-modal-tool-sha256"):
        self.digest = digest if digest is not None else hashlib.sha256()
        self._items = queue.SimpleQueue()
        self._room = threading.Semaphore(AHEAD)
        self._done = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            blob = self._items.get()
            if blob is None:
                return
            self.digest.update(blob)
            self._room.release()

    def update(self, blob):
        """Hash ``blob`` (bytes-like) after what was handed over before; waits while
        :data:`AHEAD` chunks wait."""
        if self._done is not None:
            raise ValueError("update() after hexdigest() or close()")
        if blob:
            self._room.acquire()
            self._items.put(blob)

    def hexdigest(self):
        """The SHA-256 (hex) of everything handed over; the thread ends.

        Raises:
            ValueError: after :meth:`close`."""
        if self._done is None:
            self._items.put(None)
            self._thread.join()
            self._done = self.digest.hexdigest()
        if self._done is _CLOSED:
            raise ValueError("hexdigest() after close()")
        return self._done

    def close(self):
        """End the thread once it has hashed what it holds (never waits; idempotent;
        nothing after :meth:`hexdigest`)."""
        if self._done is None:
            self._done = _CLOSED
            self._items.put(None)


_CLOSED = object()
