"""A call's output sent to the host while it runs (``"stream": true`` on a ``call``).

Stdlib-only, Python 3.8. What the command writes reaches :class:`OutputStream` through
its collector's ``sink`` and goes out as ``output`` events on the sandbox's one stream
(no new channel, no request per chunk)::

    {"id": 0, "event": "output", "target": CALL_ID, "chunks": [[1, "text"], [2, "err"]]}

(1: stdout, 2: stderr, in the order they came; with ``encoding: "bytes"`` the chunks
are base64 and the event has ``"b64": true``). Text is decoded per stream with an
incremental decoder, so a character cut between two reads is not replaced.

Bounds per slot, so that a slot that floods (``yes``) cannot hold up its neighbours:
one event per :data:`FLUSH_S` at most (the first chunk of a quiet command goes at
once), at most :data:`MAX_EVENT_BYTES` in one event, and when that much waits to be
sent the slot's pipes are not read until it is sent: the flooding command then blocks
on its full pipe, as it would writing to a slow terminal. The last event is sent before
the call's result.

Bound per sandbox, so that streamed output cannot pile up between agent and host (on
Modal the sandbox's output is buffered by the platform, ahead of every result): at most
:data:`WINDOW_BYTES` of events are unacknowledged; the host acknowledges what it got
(``{"id": 0, "op": "ack", "bytes": N}`` on the stream it already writes to, every
:data:`ACK_BYTES`), and events wait (and the slots' pipes with them) while the window
is full. Bytes count as the lengths of the chunks' strings.
"""

import base64
import codecs
import time

#: Least seconds between two events of one call.
FLUSH_S = 0.01
#: Most output bytes in one event; as much waiting pauses reading the slot's pipes.
MAX_EVENT_BYTES = 256 * 1024
#: Most streamed bytes of a sandbox the host has not acknowledged.
WINDOW_BYTES = 256 * 1024
#: The host acknowledges each time it has received this much (less than the window).
ACK_BYTES = 64 * 1024


def on_ack(agent, msg):
    """The host got ``msg["bytes"]`` more of the streamed output."""
    got = msg.get("bytes")
    if isinstance(got, int) and not isinstance(got, bool) and got > 0:
        agent.stream_unacked = max(0, getattr(agent, "stream_unacked", 0) - got)


class OutputStream:
    """Sends one call's output as ``output`` events, coalesced and bounded.

    Args:
        agent: the agent (its ``send`` and ``loop``).
        shell: the slot's shell (its ``pause_output``/``resume_output``).
        target: the call's id.
        raw: send exact bytes (base64) rather than text.
    """

    __slots__ = ("agent", "shell", "target", "raw", "runs", "size", "last", "timer", "paused",
                 "decoders", "closed")

    def __init__(self, agent, shell, target, raw):
        self.agent = agent
        self.shell = shell
        self.target = target
        self.raw = raw
        self.runs = []  # [[stream, bytearray], ...] waiting to be sent, in order
        self.size = 0
        self.last = 0.0
        self.timer = None
        self.paused = False
        self.decoders = {}
        self.closed = False

    def sink(self, stream, data):
        """The collector's sink: take ``data`` (bytes) of ``stream`` (1 or 2)."""
        if self.closed:
            return
        runs = self.runs
        if runs and runs[-1][0] == stream:
            runs[-1][1] += data
        else:
            runs.append([stream, bytearray(data)])
        self.size += len(data)
        if self.timer is None:
            wait = self.last + FLUSH_S - time.monotonic()
            if wait <= 0:
                self.flush()
                if self.runs:  # the window is full: try again later
                    self.timer = self.agent.loop.call_later(FLUSH_S, self._on_timer)
            else:
                self.timer = self.agent.loop.call_later(wait, self._on_timer)
        if self.size >= MAX_EVENT_BYTES and not self.paused:
            self.paused = True
            self.shell.pause_output()

    def _on_timer(self):
        self.timer = None
        self.flush()
        if self.runs and not self.closed:  # more than one event's worth: the next later
            self.timer = self.agent.loop.call_later(FLUSH_S, self._on_timer)
        elif self.paused:
            self.paused = False
            self.shell.resume_output()

    def flush(self, everything=False):
        """Send up to :data:`MAX_EVENT_BYTES` of what waits (all of it if ``everything``)."""
        if not self.runs:
            return
        if not everything and getattr(self.agent, "stream_unacked", 0) >= WINDOW_BYTES:
            if not self.paused:
                self.paused = True
                self.shell.pause_output()
            return
        budget = None if everything else MAX_EVENT_BYTES
        chunks = []
        while self.runs and (budget is None or budget > 0):
            stream, data = self.runs[0]
            if budget is not None and len(data) > budget:
                piece = bytes(data[:budget])
                del data[:budget]
            else:
                piece = bytes(data)
                self.runs.pop(0)
            self.size -= len(piece)
            if budget is not None:
                budget -= len(piece)
            chunks.append([stream, self._encode(stream, piece, False)])
        self._send(chunks)

    def _encode(self, stream, data, final):
        if self.raw:
            return base64.b64encode(data).decode("ascii")
        decoder = self.decoders.get(stream)
        if decoder is None:
            decoder = self.decoders[stream] = codecs.getincrementaldecoder("utf-8")("replace")
        return decoder.decode(data, final)

    def _send(self, chunks):
        chunks = [c for c in chunks if c[1]]
        if chunks:
            msg = {"id": 0, "event": "output", "target": self.target, "chunks": chunks}
            if self.raw:
                msg["b64"] = True
            self.agent.stream_unacked = (getattr(self.agent, "stream_unacked", 0)
                                         + sum(len(c[1]) for c in chunks))
            self.agent.send(msg)
        self.last = time.monotonic()

    def close(self):
        """Send everything left (before the call's result) and stop."""
        if self.closed:
            return
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.flush(everything=True)
        if not self.raw:  # what a decoder still holds: an incomplete character at the end
            self._send([[s, d.decode(b"", True)] for s, d in sorted(self.decoders.items())])
        self.closed = True
        if self.paused:
            self.paused = False
            self.shell.resume_output()
