"""One command's output, collected up to its end marker with a cap on what is kept.

Stdlib-only, Python 3.8. The end of a command is a marker line ``\\036NONCE RC\\036``
with a fresh random nonce per command, so a command cannot end another command's output
by printing something that looks like it.
"""

import re

MARK = b"\x1e"
#: Bytes after a marker's prefix within which its end must come (an exit code: "-1".."255").
MARKER_TAIL = 8


class OutputCollector:
    """Collects one command's output up to its end marker, keeping head and tail.

    Args:
        nonce: the command's marker nonce (bytes).
        limit: the output cap in characters; at most about ``4 * limit`` bytes are held.
    """

    __slots__ = ("_prefix", "limit", "head", "tail", "dropped", "_pending", "returncode",
                 "ended", "_future", "_keep", "source", "one_line", "loop")

    def __init__(self, nonce, limit, loop):
        self._prefix = MARK + nonce + b" "
        self.source = None  # the sourced command file's path (bytes): bash names it in errors
        self.one_line = False
        self.limit = limit
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self._pending = bytearray()
        self.returncode = None
        self.ended = None  # None while collecting; then True (the marker came) or False
        self._future = None  # made only for whoever waits (the fast path has a callback)
        self.loop = loop
        self._keep = len(self._prefix) + 16

    def feed(self, data):
        """Take output; linear in it, and never holding more than a marker's length of it
        unstored (output that prints the marker's prefix without its end is output)."""
        if self.ended is not None:
            return
        pend = self._pending
        pend += data
        plen = len(self._prefix)
        while True:
            idx = pend.find(self._prefix)
            if idx < 0:
                break
            end = pend.find(MARK, idx + plen, idx + plen + MARKER_TAIL)
            if end >= 0:
                try:
                    self.returncode = int(pend[idx + plen:end])
                except ValueError:
                    self.returncode = -1
                self._store(bytes(pend[:idx]))
                del pend[:]
                self._end(True)
                return
            if len(pend) - (idx + plen) < MARKER_TAIL:
                self._store(bytes(pend[:idx]))  # maybe the marker: wait for its end
                del pend[:idx]
                return
            # Not a marker (a real one ends within a few digits): it is output.
            self._store(bytes(pend[:idx + 1]))
            del pend[:idx + 1]
        if len(pend) > self._keep:
            cut = len(pend) - self._keep
            self._store(bytes(pend[:cut]))
            del pend[:cut]

    def append(self, data):
        """Add output that belongs to this command but came after its end marker."""
        self._store(data)

    def _unname(self, data):
        if self.source is None or self.source not in data:
            return data
        return _unname_in(data, self.source, self.one_line)

    def finish(self, returncode=None):
        """End collection without a marker (shell died or was killed)."""
        if self.ended is not None:
            return
        self._store(bytes(self._pending))
        del self._pending[:]
        self.returncode = returncode
        self._end(False)

    def _end(self, ended):
        self.ended = ended
        if self._future is not None and not self._future.done():
            self._future.set_result(ended)

    def wait(self):
        """A future of :attr:`ended` (True: the end marker came; False: the shell ended or
        was killed first); made on demand, since the fast path needs none."""
        if self._future is None:
            self._future = self.loop.create_future()
            if self.ended is not None:
                self._future.set_result(self.ended)
        return self._future

    def _store(self, data):
        if not data:
            return
        cap = 2 * self.limit
        room = cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
            if not data:
                return
        self.tail += data
        if len(self.tail) > cap:
            extra = len(self.tail) - cap
            self.dropped += extra
            del self.tail[:extra]

    def text(self):
        """Return ``(text, truncated)``: decoded with replacement, capped, marker in the middle.

        Bash names the file it sources in its messages (``/run/hmt/cmd: line 1: x: command
        not found``): that internal path is shown as bash's own name, as a terminal shows it
        (``bash: x: command not found``; ``bash: line N:`` for a command of several lines).
        """
        head = self._unname(bytes(self.head)).decode("utf-8", "replace")
        tail = self._unname(bytes(self.tail)).decode("utf-8", "replace")
        total = len(head) + len(tail) + self.dropped
        if total <= self.limit:
            return head + tail, False
        keep = self.limit // 2
        text = head + tail
        if self.dropped == 0:
            omitted = len(text) - 2 * keep
            return (text[:keep] + marker(omitted) + text[len(text) - keep:], True)
        first = head[:keep]
        last = tail[len(tail) - keep:] if len(tail) >= keep else (head + tail)[-keep:]
        omitted = total - len(first) - len(last)
        return first + marker(omitted) + last, True


def _unname_in(data, source, one_line):
    pattern = re.compile(re.escape(source) + rb": line (\d+): ")
    return pattern.sub(b"bash: " if one_line else rb"bash: line \1: ", data)


def marker(omitted):
    return "\n\n... [output truncated: %d characters omitted] ...\n\n" % omitted
