"""An ``upload`` stream: chunks from the host written to a slot's file, or unpacked as a
tar stream beneath a slot's directory, in the stream's own thread (see :mod:`.streams`).

Stdlib-only, Python 3.8.
"""

import os
import queue

from . import files, tarstream
from .streambase import CHUNK_BYTES, Stream, StreamError, text_of

#: Bytes of a file upload's chunks answered as they arrive (queued for the stream's thread,
#: not yet written); past them a chunk is answered once written. The host's window then
#: covers the way here, and the thread finds the next chunks queued when it is done with
#: one: answered only once written, a chunk's answer went back to the host, and the next
#: chunk came, while the thread waited (py-spy: it waited for chunks 92% of an upload,
#: both loops were half idle). A write that fails is answered to a later chunk, or to the
#: end: the host's upload fails all the same, only a little later.
AHEAD_BYTES = 2 * 1024 * 1024


class Upload(Stream):
    """A stream into the slot: a file (``kind`` ``file``) or a tree (``tar``)."""

    op = "upload"

    def __init__(self, *args):
        super().__init__(*args)
        self.items = queue.Queue()  # ("data", mid, blob) / ("end", mid) / ("abort", mid)
        self.error = None
        self.taken = None  # the request whose chunk is being written (unanswered)
        self.end_id = None  # the end request, once taken
        self.ahead = 0  # bytes of chunks answered on arrival, not yet written (on the loop)

    def request(self, msg):
        mid = msg.get("id")
        if msg.get("abort"):
            self.abort(mid)
        elif msg.get("end"):
            self.items.put(("end", mid, None))
        else:
            blob = msg.get("blob")
            if not isinstance(blob, (bytes, bytearray)):
                raise StreamError("an upload chunk must come in a binary frame")
            if self.kind == "file" and self.error is None and self.ahead + len(blob) <= AHEAD_BYTES:
                self.ahead += len(blob)
                self.agent.send({"id": mid, "ok": True, "result": {"queued": True}})
                mid = None  # answered: the thread only tells the loop when it is written
            self.items.put(("data", mid, blob))

    def _wrote(self, nbytes):
        """A chunk answered on arrival is written (on the loop)."""
        self.ahead -= nbytes

    def abort(self, mid=None):
        self.aborted = True
        self.items.put(("abort", mid, None))

    def failed(self, exc):
        self.error = text_of(exc)
        if self.open_id is not None:  # refused before it started
            self.reply(self.open_id, error=self.error)
            return
        if self.taken is not None:
            self.reply(self.taken, error=self.error)
            self.taken = None
        if self.end_id is not None:
            self.reply(self.end_id, error=self.error)
            return
        while True:  # answer what is still to come with the error, until the end
            kind, mid, _ = self.items.get()
            if mid is not None:
                self.reply(mid, error=self.error)
            if kind in ("end", "abort"):
                return

    def _started(self):
        self.reply(self.open_id, {"stream": self.sid})
        self.open_id = None

    def serve(self):
        if self.kind == "tar":
            fd, shown = self._open_dir(create=True)
            try:
                self._started()
                reader = _ItemReader(self)
                made, size = tarstream.unpack(reader, fd, self._owner())
                while not reader.ended:  # the tar's end: the rest is padding
                    reader.read(CHUNK_BYTES)
            finally:
                os.close(fd)
            self.reply(self.end_id, {"size": size, "bytes": size, "files": made, "path": shown,
                                       "sha256": self.digest.hexdigest(), "stream_bytes": reader.got})
            return
        fd, shown = self._open_file()
        try:
            self._started()
            written = 0
            while True:
                kind, mid, blob = self.items.get()
                if kind == "abort":
                    if mid is not None:
                        self.reply(mid)
                    return
                if kind == "end":
                    self.end_id = mid
                    break
                self.taken = mid
                view = memoryview(blob)
                while view:
                    view = view[os.write(fd, view):]
                self.digest.update(blob)
                written += len(blob)
                self.taken = None
                if mid is None:
                    self.agent.loop.call_soon_threadsafe(self._wrote, len(blob))
                else:
                    self.reply(mid, {"written": written})
            if self.meta is not None:  # a resumed directory's file: the mode and time its tar member had
                os.fchmod(fd, int(self.meta[0]) & 0o1777)
                os.utime(fd, (int(self.meta[1]), int(self.meta[1])))
            size = os.fstat(fd).st_size  # what the file holds, not what was counted
        finally:
            os.close(fd)
        self.reply(mid, {"size": size, "bytes": written, "files": 1, "path": shown,
                         "sha256": self.digest.hexdigest()})

    def _owner(self):
        ws = self.slot.workspace
        return (ws.uid, ws.gid) if ws.uid is not None else None

    def _open_file(self):
        """The slot's file, open for writing as ``write_file`` opens it
        (``Workspace.open_for_write``); emptied, or for a resume checked to hold exactly
        the ``offset`` bytes the host has (by SHA-256)."""
        ws = self.slot.workspace
        try:
            fd, shown = ws.open_for_write(self.path, truncate=not self.offset,
                                          must_exist=bool(self.offset), readable=True)
        except files.FileToolError as exc:
            if self.offset and str(exc).startswith("no such file"):
                raise StreamError("cannot resume at offset %d: %s" % (self.offset, exc)) from None
            raise
        try:
            if self.offset:
                self._check_prefix(fd, os.fstat(fd).st_size, shown)
                os.lseek(fd, self.offset, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        return fd, shown

    def _check_prefix(self, fd, size, shown):
        if size != self.offset:
            raise StreamError("cannot resume at offset %d: the slot's file %s has %d bytes"
                              % (self.offset, shown, size))
        left = size
        while left:
            piece = os.read(fd, min(left, CHUNK_BYTES))
            if not piece:
                break
            self.digest.update(piece)
            left -= len(piece)
        if self.digest.hexdigest() != self.expect_prefix:
            raise StreamError("cannot resume at offset %d: the slot's file %s has %d bytes that "
                              "differ from the local file's first ones" % (self.offset, shown, size))


class _ItemReader:
    """The chunks of an upload as a file object for :func:`tarstream.unpack` (a chunk is
    answered once read whole: the host's window is the flow control)."""

    def __init__(self, stream):
        self.stream = stream
        self.view = memoryview(b"")
        self.ended = False
        self.got = 0

    def read(self, n=-1):
        stream = self.stream
        while not self.view:
            if stream.taken is not None:
                stream.reply(stream.taken, {"written": self.got})
                stream.taken = None
            if self.ended:
                return b""
            kind, mid, blob = stream.items.get()
            if kind == "abort":
                stream.items.put((kind, mid, blob))  # for failed() to answer
                raise StreamError("the upload was aborted")
            if kind == "end":
                self.ended = True
                stream.end_id = mid
                return b""
            stream.taken = mid
            self.view = memoryview(blob)
            stream.digest.update(blob)
            self.got += len(blob)
        if n is None or n < 0:
            n = len(self.view)
        out = self.view[:n].tobytes()
        self.view = self.view[n:]
        return out
