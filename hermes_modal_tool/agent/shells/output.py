"""One command's output, collected up to its end marker with a cap on what is kept.

Stdlib-only, Python 3.8. The end of a command is a marker line ``\\036NONCE RC\\036``
with a fresh random nonce per command, so a command cannot end another command's output
by printing something that looks like it.

Stdout and stderr come from two pipes but are stored once, interleaved in arrival
order (what the model reads): the collector keeps one head and one tail buffer for both
and notes the byte ranges that came from stderr (:attr:`OutputCollector.spans`, None
until stderr writes). The separate ``stdout`` and ``stderr`` views are cut from those
buffers at the end, and only when stderr wrote something; a command that wrote only to
stdout (the common path) costs one empty read of the stderr pipe and nothing more.
A call that asks for exact bytes (``encoding="bytes"``) also keeps the first ``limit``
bytes of each stream as they came (:attr:`OutputCollector.raw`).
"""

import base64
import re

MARK = b"\x1e"
#: Bytes after a marker's prefix within which its end must come (an exit code: "-1".."255").
MARKER_TAIL = 8
#: Spans of stderr kept before those in the dropped middle of the output are forgotten.
MAX_SPANS = 256


class OutputCollector:
    """Collects one command's output up to its end marker, keeping head and tail.

    Args:
        nonce: the command's marker nonce (bytes).
        limit: the output cap in characters; at most about ``4 * limit`` bytes are held
            (plus ``2 * limit`` when exact bytes are kept, see :meth:`keep_raw`).
    """

    __slots__ = ("_prefix", "limit", "head", "tail", "dropped", "_pending", "returncode",
                 "ended", "_future", "source", "one_line", "loop", "spans", "stored",
                 "err_total", "raw", "totals", "sink")

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
        self.spans = None  # [[start, end], ...] of stored bytes that came from stderr
        self.stored = 0  # bytes stored so far (head, dropped middle and tail)
        self.err_total = 0
        self.raw = None  # [stdout, stderr] exact prefixes, when asked for
        self.totals = [0, 0]  # bytes each stream wrote (counted only with raw)
        self.sink = None  # sink(stream, data): live output (stream 1 stdout, 2 stderr)

    def keep_raw(self):
        """Also keep each stream's first ``limit`` bytes exactly (``encoding="bytes"``)."""
        self.raw = [bytearray(), bytearray()]

    def feed(self, data):
        """Take stdout; linear in it, and holding back only what may begin the end marker
        (output that prints the marker's prefix without its end is output)."""
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
                self._out(bytes(pend[:idx]))
                del pend[:]
                self._end(True)
                return
            if len(pend) - (idx + plen) < MARKER_TAIL:
                self._out(bytes(pend[:idx]))  # maybe the marker: wait for its end
                del pend[:idx]
                return
            # Not a marker (a real one ends within a few digits): it is output.
            self._out(bytes(pend[:idx + 1]))
            del pend[:idx + 1]
        # Keep back only what may begin a marker (stdout and stderr stay in order).
        cut = pend.rfind(MARK)
        if cut < 0 or not self._prefix.startswith(bytes(pend[cut:])):
            cut = len(pend)
        if cut:
            self._out(bytes(pend[:cut]))
            del pend[:cut]

    def feed_err(self, data):
        """Take stderr (no marker comes on it); also after the end marker, since the
        shell drains stderr when the marker arrives."""
        if not data:
            return
        data = self._unname(data)
        if self.raw is not None:
            self._raw(1, data)
        if self.sink is not None:
            self.sink(2, data)
        start = self.stored
        spans = self.spans
        if spans is None:
            spans = self.spans = []
        if spans and spans[-1][1] == start:
            spans[-1][1] = start + len(data)
        else:
            spans.append([start, start + len(data)])
            if len(spans) > MAX_SPANS:
                self._forget_spans()
        self.err_total += len(data)
        self._store(data)

    def _out(self, data):
        if not data:
            return
        data = self._unname(data)
        if self.raw is not None:
            self._raw(0, data)
        if self.sink is not None:
            self.sink(1, data)
        self._store(data)

    def _raw(self, stream, data):
        self.totals[stream] += len(data)
        buf = self.raw[stream]
        room = self.limit - len(buf)
        if room > 0:
            buf += data[:room]

    def _forget_spans(self):
        """Drop spans wholly inside the dropped middle (their bytes are gone)."""
        lo = len(self.head)
        hi = self.stored - len(self.tail)
        self.spans = [s for s in self.spans if not (s[0] >= lo and s[1] <= hi)]

    def append(self, data):
        """Add stdout that belongs to this command but came after its end marker."""
        self._out(data)

    def absorb(self, other):
        """Add what another collector kept (bash's job notices after an interrupt)."""
        for stream, chunk in other.pieces():
            if stream == 2:
                self.feed_err(chunk)
            else:
                self._out(chunk)

    def _unname(self, data):
        if self.source is None or self.source not in data:
            return data
        return _unname_in(data, self.source, self.one_line)

    def finish(self, returncode=None):
        """End collection without a marker (shell died or was killed)."""
        if self.ended is not None:
            return
        self._out(bytes(self._pending))
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
        self.stored += len(data)
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

    def pieces(self):
        """The kept bytes as ``[(stream, bytes), ...]`` in order (1 stdout, 2 stderr)."""
        out = []
        tail_start = self.stored - len(self.tail)
        for base, buf in ((0, self.head), (tail_start, self.tail)):
            pos = base
            end = base + len(buf)
            for s0, s1 in self.spans or ():
                s0, s1 = max(s0, pos), min(s1, end)
                if s0 >= s1:
                    continue
                if s0 > pos:
                    out.append((1, bytes(buf[pos - base:s0 - base])))
                out.append((2, bytes(buf[s0 - base:s1 - base])))
                pos = s1
            if pos < end:
                out.append((1, bytes(buf[pos - base:])))
        return out

    def text(self):
        """Return ``(text, truncated)``: decoded with replacement, capped, marker in the middle.

        Bash names the file it sources in its messages (``/run/hmt/cmd: line 1: x: command
        not found``): that internal path is shown as bash's own name, as a terminal shows it
        (``bash: x: command not found``; ``bash: line N:`` for a command of several lines).
        """
        if self.spans is None:
            head = bytes(self.head).decode("utf-8", "replace")
            tail = bytes(self.tail).decode("utf-8", "replace")
            return capped(head, tail, self.dropped, self.limit)
        text, truncated, _ = self._views()
        return text, truncated

    def _views(self):
        """The interleaved text and the two streams' texts, each decoded per run of one
        stream (a character is never made of two streams' bytes) and capped."""
        head = {0: [], 1: [], 2: []}
        tail = {0: [], 1: [], 2: []}
        kept = [0, 0, 0]
        for stream, chunk in self.pieces():
            side = head if sum(kept) < len(self.head) else tail
            kept[stream] += len(chunk)
            text = chunk.decode("utf-8", "replace")
            side[0].append(text)
            side[stream].append(text)
        total_err = self.err_total
        total_out = self.stored - total_err
        streams = {}
        for stream, total in ((1, total_out), (2, total_err)):
            streams[stream] = capped("".join(head[stream]), "".join(tail[stream]),
                                     total - kept[stream], self.limit)
        text, truncated = capped("".join(head[0]), "".join(tail[0]), self.dropped, self.limit)
        return text, truncated, streams

    def result_fields(self):
        """The call result's stream keys: ``stdout``/``stderr`` texts when stderr wrote
        (else none: the host takes ``output`` as stdout), ``stdout_b64``/``stderr_b64``
        and ``stdout_bytes``/``stderr_bytes`` (totals) when exact bytes were kept; and
        whether a stream was capped."""
        fields = {}
        truncated = False
        if self.spans is not None:
            _, _, streams = self._views()
            fields["stdout"], cut_out = streams[1]
            fields["stderr"], cut_err = streams[2]
            truncated = cut_out or cut_err
        if self.raw is not None:
            for i, name in enumerate(("stdout", "stderr")):
                fields[name + "_b64"] = base64.b64encode(bytes(self.raw[i])).decode("ascii")
                fields[name + "_bytes"] = self.totals[i]
                truncated = truncated or self.totals[i] > len(self.raw[i])
        return fields, truncated


def capped(head, tail, dropped, limit):
    """``(text, truncated)`` of a head and tail with ``dropped`` characters between them,
    cut to ``limit`` characters with a marker in the middle."""
    total = len(head) + len(tail) + dropped
    if total <= limit:
        return head + tail, False
    keep = limit // 2
    text = head + tail
    if dropped == 0:
        omitted = len(text) - 2 * keep
        return (text[:keep] + marker(omitted) + text[len(text) - keep:], True)
    first = head[:keep]
    last = tail[len(tail) - keep:] if len(tail) >= keep else (head + tail)[-keep:]
    omitted = total - len(first) - len(last)
    return first + marker(omitted) + last, True


def _unname_in(data, source, one_line):
    pattern = re.compile(re.escape(source) + rb": (?:eval: )?line (\d+): ")  # a syntax error: eval
    return pattern.sub(b"bash: " if one_line else rb"bash: line \1: ", data)


def marker(omitted):
    return "\n\n... [output truncated: %d characters omitted] ...\n\n" % omitted
