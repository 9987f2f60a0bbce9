"""An ``upload`` stream: chunks from the host written to a slot's file, or unpacked as a
tar stream beneath a slot's directory, in the stream's own thread (see :mod:`.streams`).

Stdlib-only, Python 3.8.
"""

import os
import queue

from . import files, tarstream
from .hashthread import HashThread, Inline, hasher
from .streambase import CHUNK_BYTES, Stream, StreamError, text_of

#: Bytes of a file upload's chunks answered as they arrive (queued for the stream's thread,
#: not yet written); past them a chunk is answered once written. The host's window then
#: covers the way here, and the thread finds the next chunks queued when it is done with
#: one: answered only once written, a chunk's answer went back to the host, and the next
#: chunk came, while the thread waited (py-spy: it waited for chunks 92% of an upload,
#: both loops were half idle). A write that fails is answered to a later chunk, or to the
#: end: the host's upload fails all the same, only a little later.
AHEAD_BYTES = 2 * 1024 * 1024
#: Bytes of queued chunks the stream's thread takes at once and writes in one ``writev``.
WRITE_BATCH = 2 * 1024 * 1024


class Upload(Stream):
    """A stream into the slot: a file (``kind`` ``file``) or a tree (``tar``)."""

    op = "upload"

    def __init__(self, *args):
        super().__init__(*args)
        self.items = queue.Queue()  # ("data", mid, blob) / ("end", mid) / ("abort", mid)
        self.error = None
        self.taken = []  # the requests whose chunks are being written (unanswered)
        self.closing = None  # the end or abort request taken with the last chunks
        self.end_id = None  # the end request, once taken
        # Bytes of chunks answered on arrival (counted on the loop) and of those written
        # (counted by the thread): their difference waits. Two counters, each with one
        # writer, so the thread tells the loop nothing per chunk (before: a wakeup of the
        # loop per chunk, through its self-pipe).
        self.ahead_in = 0
        self.ahead_out = 0

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
            if (self.kind == "file" and self.error is None
                    and self.ahead_in - self.ahead_out + len(blob) <= AHEAD_BYTES):
                self.ahead_in += len(blob)
                self.agent.send({"id": mid, "ok": True, "result": {"queued": True}})
                mid = None  # answered: the thread counts it in ahead_out once written
            self.items.put(("data", mid, blob))

    def abort(self, mid=None):
        self.aborted = True
        self.items.put(("abort", mid, None))

    def failed(self, exc):
        self.error = text_of(exc)
        if self.open_id is not None:  # refused before it started
            self.reply(self.open_id, error=self.error)
            return
        taken, self.taken = self.taken, []
        for mid in taken:
            self.reply(mid, error=self.error)
        for mid in (self.end_id, self.closing):
            if mid is not None:  # the end (or the abort) was taken already
                self.reply(mid, error=self.error)
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
            self.digest = hasher(self.digest, self.hash_thread)  # beside the writes (after a resume's prefix)
            self._started()
            written = self._write_chunks(fd)
            if written is None:  # aborted: its request is answered
                return
            if self.meta is not None:  # a resumed directory's file: the mode and time its tar member had
                os.fchmod(fd, int(self.meta[0]) & 0o1777)
                os.utime(fd, (int(self.meta[1]), int(self.meta[1])))
            size = os.fstat(fd).st_size  # what the file holds, not what was counted
            sha256 = self.digest.hexdigest()
        finally:
            if isinstance(self.digest, (HashThread, Inline)):
                self.digest.close()
            os.close(fd)
        self.reply(self.end_id, {"size": size, "bytes": written, "files": 1, "path": shown,
                                 "sha256": sha256})

    def _write_chunks(self, fd):
        """Write the chunks that come to ``fd`` until the end (its id kept in
        ``end_id``) or an abort; return the bytes written (None after an abort). The
        chunks queued when the thread wakes go in one ``writev``; should it fail, every
        request it took is answered by :meth:`failed`."""
        written = 0
        while True:
            got = self._take()
            last_kind, last_mid, _ = got[-1]
            if last_kind != "data":
                self.closing = last_mid  # failed() answers it, should the writes fail
                got.pop()
            if got:
                self.taken = [mid for _, mid, _ in got if mid is not None]
                for _, _, blob in got:
                    self.digest.update(blob)  # hashed in its thread while written here
                _write_all(fd, [blob for _, _, blob in got])
                self.taken = []
                for _, mid, blob in got:
                    written += len(blob)
                    if mid is None:
                        self.ahead_out += len(blob)
                    else:
                        self.reply(mid, {"written": written})
            if last_kind == "abort":
                if last_mid is not None:
                    self.reply(last_mid)
                return None
            if last_kind == "end":
                self.end_id = last_mid
                return written

    def _take(self):
        """The items queued now, at least one (waiting for it), chunks of at most
        :data:`WRITE_BATCH` bytes in all (and one more); an ``end`` or ``abort`` comes last."""
        got = [self.items.get()]
        size = len(got[0][2] or b"")
        while got[-1][0] == "data" and size < WRITE_BATCH:
            try:
                item = self.items.get_nowait()
            except queue.Empty:
                break
            got.append(item)
            size += len(item[2] or b"")
        return got

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


def _write_all(fd, chunks):
    """Write ``chunks`` (bytes-like) to ``fd`` in order: one ``writev`` for all of them
    (one system call and one release of the GIL, not one per chunk), again for what a
    short write left."""
    views = [memoryview(c) for c in chunks]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


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
            for taken in stream.taken:
                stream.reply(taken, {"written": self.got})
            stream.taken = []
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
            stream.taken = [mid] if mid is not None else []
            self.view = memoryview(blob)
            stream.digest.update(blob)
            self.got += len(blob)
        if n is None or n < 0:
            n = len(self.view)
        out = self.view[:n].tobytes()
        self.view = self.view[n:]
        return out
