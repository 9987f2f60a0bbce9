"""A *probe* stream: what the framed stream between the host and the agent carries for a
transfer's traffic, without a file (``benchmarks/transfer.py``'s ``stream`` row; the
host's end is ``hermes_modal_tool/_transfer_probe.py``).

An ``upload`` with ``kind: "probe"`` takes binary frames and answers each at once, on
the loop (nothing written, nothing hashed); a ``download`` with ``kind: "probe"`` and
``size`` answers each request with a binary frame of :data:`CHUNK_BYTES` (one bytes
object made once, sent again and again) until ``size`` bytes went out, under the same
rule as a download's chunks (``streamout.hold_back``). So the probe pays everything a transfer pays on the stream (encoding, the pipes,
decoding, one request and one reply per chunk, the window) and nothing else: no thread,
no file, no checksum. It touches no slot's files; its memory is one chunk.

Stdlib-only, Python 3.8.
"""

from .streambase import CHUNK_BYTES, StreamError, streams_of
from .streamout import hold_back

#: The bytes every download probe chunk carries (made on first use).
_BLOCK = []


def _block():
    if not _BLOCK:
        _BLOCK.append(bytes(range(256)) * (CHUNK_BYTES // 256))
    return _BLOCK[0]


class Probe:
    """One probe stream (``op`` ``upload`` or ``download``), served on the loop."""

    def __init__(self, agent, slot, sid, op, size):
        self.agent = agent
        self.slot = slot
        self.sid = sid
        self.op = op
        self.left = size  # download: bytes still to send
        self.moved = 0
        self.waiting = []  # download requests held back while the host's backlog is large
        self.retry = None

    def request(self, msg):
        mid = msg.get("id")
        if msg.get("abort") or msg.get("end"):
            self.abort()
            streams_of(self.agent).pop(self.sid, None)
            self.agent.send({"id": mid, "ok": True, "result": {"bytes": self.moved}})
            return
        if self.op == "upload":
            blob = msg.get("blob")
            if not isinstance(blob, (bytes, bytearray)):
                raise StreamError("an upload chunk must come in a binary frame")
            self.moved += len(blob)
            self.agent.send({"id": mid, "ok": True, "result": {"written": self.moved}})
            return
        self.waiting.append(mid)
        if self.retry is not None:  # the host took a chunk: look now (streamout.hold_back)
            self.retry.cancel()
        self._pair()

    def _pair(self):
        self.retry = None
        agent = self.agent
        while self.waiting:
            if self.left:
                self.retry = hold_back(agent, self._pair)
                if self.retry is not None:
                    return
            mid = self.waiting.pop(0)
            n = min(self.left, CHUNK_BYTES)
            if n <= 0:
                agent.send({"id": mid, "ok": True, "result": {"eof": True, "bytes": self.moved}, "blob": b""})
                continue
            block = _block()
            self.left -= n
            self.moved += n
            agent.send({"id": mid, "ok": True, "result": {"eof": False},
                        "blob": block if n == len(block) else block[:n]})

    def abort(self, mid=None):
        if self.retry is not None:
            self.retry.cancel()
            self.retry = None
