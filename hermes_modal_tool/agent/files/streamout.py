"""A ``download`` stream: a slot's file, or a directory as a tar stream, read into chunks
in the stream's own thread, at most ``READ_AHEAD`` ahead of the host (see :mod:`.streams`).

Stdlib-only, Python 3.8.
"""

import array
import collections
import fcntl
import os
import stat
import termios
import threading

from . import files, tarstream, treesums
from .hashthread import hasher
from .streambase import (
    CHUNK_BYTES,
    MAX_LISTED,
    READ_AHEAD,
    Stream,
    StreamError,
    streams_of,
    text_of,
)

#: Bytes of frames waiting for the host (in the agent and in the pipe, not yet read) at
#: which a download chunk waits: a neighbour's result waits behind less than two chunks.
#: (512 KiB moved the stream probe's down faster, 670-1157 MB/s against 337-675, but
#: doubled the neighbour's echo p99 during a download on the loaded 2-core machine:
#: 5.1-7.3 ms against 3.0-3.4 at main; with the host asking 8 chunks ahead and the frame
#: decoder's copies gone, 256 KiB gave 4.6/6.6 ms at main's 4.5/5.5, download MB/s equal.)
PIPE_BACKLOG = 256 * 1024
#: Bytes in the transport's own buffer past which a held chunk looks again only after
#: :data:`BULK_RETRY_S` (or at the host's next request), not right after the flush.
BULK_BACKLOG = 256 * 1024
#: Seconds before a chunk held back looks again.
BULK_RETRY_S = 0.001


def hold_back(agent, again):
    """None when a download chunk may be queued for the host now; else the handle of
    ``again`` called later. A chunk waits while :data:`PIPE_BACKLOG` bytes or more of
    frames wait for the host (in the transport's buffer, among the frames of this loop
    pass, and in the pipe, not yet read), so that a neighbour's result is never behind
    more than that and one chunk of a transfer. When the frames of this pass are about
    to be written (the flush is due at once), it looks again right after the flush
    (before, it waited :data:`BULK_RETRY_S` each time: one chunk per millisecond at most,
    145 MB/s by the stream probe where 536 came without the wait); else at the host's
    next request (it asks for a chunk when it has taken one out of the pipe), and every
    :data:`BULK_RETRY_S`."""
    buffered = agent.out.get_write_buffer_size()
    queued = sum(len(frame) for frame in agent.outbox)
    if buffered + queued + _in_pipe(agent) < PIPE_BACKLOG:
        return None
    if buffered < BULK_BACKLOG and agent.flush_soon:
        return agent.loop.call_soon(again)
    return agent.loop.call_later(BULK_RETRY_S, again)


def _in_pipe(agent):
    """Bytes written to the pipe to the host and not yet read by it (``FIONREAD``); 0
    where the agent's stdout is no pipe."""
    fd = getattr(agent, "out_pipe_fd", None)
    if fd is None:
        fd = -1
        pipe = agent.out.get_extra_info("pipe")
        try:
            if pipe is not None and stat.S_ISFIFO(os.fstat(pipe.fileno()).st_mode):
                fd = pipe.fileno()
        except (OSError, ValueError):
            pass
        agent.out_pipe_fd = fd
    if fd < 0:
        return 0
    count = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, count)
    except OSError:
        return 0
    return count[0]


class Download(Stream):
    """A stream out of the slot: a file, or a directory as a tar stream."""

    op = "download"

    def __init__(self, *args):
        super().__init__(*args)
        self.room = threading.Semaphore(READ_AHEAD)  # chunks read and not yet sent
        self.ready = collections.deque()  # ("data", bytes) / ("end", result) / ("error", text)
        self.waiting = collections.deque()  # request ids with no chunk yet
        self.final = None  # the last reply, repeated to requests past the end
        self.retry = None  # the timer of a chunk held back (see _pair)

    # -- on the loop ---------------------------------------------------------------
    def request(self, msg):
        mid = msg.get("id")
        if msg.get("abort"):
            self.abort()
            streams_of(self.agent).pop(self.sid, None)
            self.agent.send({"id": mid, "ok": True, "result": {}})
            return
        self.waiting.append(mid)
        if self.retry is not None:  # the host took a chunk: look now (hold_back)
            self.retry.cancel()
        self._pair()

    def _offer(self, item):
        self.ready.append(item)
        if self.retry is None:
            self._pair()

    def _pair(self):
        self.retry = None
        while self.waiting and (self.ready or self.final is not None):
            if self.final is None and self.ready[0][0] == "data":
                self.retry = hold_back(self.agent, self._pair)
                if self.retry is not None:
                    return
            mid = self.waiting.popleft()
            if self.final is not None:
                kind, value = self.final
            else:
                kind, value = self.ready.popleft()
                if kind == "data":
                    self.room.release()
                else:
                    self.final = (kind, value)
            if kind == "error":
                self.agent.send({"id": mid, "ok": False, "error": value})
            elif kind == "data":
                self.agent.send({"id": mid, "ok": True, "result": {"eof": False}, "blob": value})
            else:
                self.agent.send({"id": mid, "ok": True, "result": value, "blob": b""})

    def abort(self, mid=None):
        self.aborted = True
        self.room.release()
        if self.retry is not None:
            self.retry.cancel()
            self.retry = None

    # -- in the stream's thread ----------------------------------------------------------
    def _put(self, item):
        self.agent.loop.call_soon_threadsafe(self._offer, item)

    def _chunk(self, data):
        self.room.acquire()
        if self.aborted:
            raise StreamError("the download was aborted")
        self._put(("data", data))

    def failed(self, exc):
        if self.open_id is not None:
            self.reply(self.open_id, error=text_of(exc))
        elif not self.aborted:
            self._put(("error", text_of(exc)))

    def forget(self):
        pass  # the host's closing request drops it (it may still ask past the end)

    def _listed(self):
        """The host's list (``listing``): JSON lines of ``[name, size]`` (a manifest's
        prefixes) or of ``name`` (a tar stream's files to leave out)."""
        if not self.listing:
            return []
        try:
            return treesums.parse_lines(self.listing, MAX_LISTED)
        except ValueError as exc:
            raise StreamError("the resume list is not JSON lines of at most %d names: %s"
                              % (MAX_LISTED, exc)) from None

    def _manifest(self):
        """``kind: "manifest"``: the directory's files with their sums (``treesums``), a
        missing directory as an empty one."""
        prefixes = {}
        for item in self._listed():
            if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                    or not isinstance(item[1], int)):
                raise StreamError("a manifest's prefix must be [name, size], got %r" % (item,))
            prefixes[item[0]] = item[1]
        try:
            fd, shown = self._open_dir(create=False)
        except (StreamError, files.FileToolError) as exc:
            if not str(exc).startswith("no such"):
                if "is not a directory" in str(exc):
                    raise StreamError("%s is not a directory: a file resumes into a local "
                                      "file path" % self.path) from None
                raise
            self.reply(self.open_id, {"stream": self.sid, "kind": "manifest", "missing": True})
            self.open_id = None
            self._put(("end", {"eof": True, "files": 0, "sha256": self.digest.hexdigest()}))
            return
        try:
            self.reply(self.open_id, {"stream": self.sid, "kind": "manifest", "path": shown})
            self.open_id = None
            out = _Chunker(self)
            made = treesums.manifest(fd, out, self.slot.workspace.uid, prefixes)
            out.flush()
        finally:
            os.close(fd)
        self._put(("end", {"eof": True, "files": made, "sha256": self.digest.hexdigest(),
                           "stream_bytes": out.sent}))

    def serve(self):
        if self.kind == "manifest":
            self._manifest()
            return
        ws = self.slot.workspace
        dir_fd, name, shown = ws.walk(self.path)
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False) if name is not None else None
        except FileNotFoundError:
            raise StreamError("no such file or directory: %s" % shown) from None
        finally:
            os.close(dir_fd)
        if st is None or stat.S_ISDIR(st.st_mode):
            if self.offset:
                raise StreamError("offset applies to a single file; %s is a directory" % shown)
            listed = self._listed()
            if not all(isinstance(n, str) for n in listed):
                raise StreamError("a resumed download's list must hold names")
            leave_out = set(listed)
            fd, shown = self._open_dir(create=False)
            try:
                self.reply(self.open_id, {"stream": self.sid, "kind": "dir", "path": shown})
                self.open_id = None
                out = _Chunker(self)
                made, size, skipped = tarstream.pack(fd, out, ws.uid, skip=leave_out)
                out.flush()
            finally:
                os.close(fd)
            self._put(("end", {"eof": True, "files": made, "size": size, "bytes": size,
                               "skipped": skipped, "sha256": self.digest.hexdigest(),
                               "stream_bytes": out.sent}))
            return
        fh, st, shown = ws.open_read(self.path)
        with fh:
            fd = fh.fileno()
            self.reply(self.open_id, {"stream": self.sid, "kind": "file", "path": shown,
                                      "size": st.st_size})
            self.open_id = None
            at = 0
            while at < self.offset:  # the host's first bytes: in the checksum, not sent
                piece = os.pread(fd, min(CHUNK_BYTES, self.offset - at), at)
                if not piece:
                    break
                self.digest.update(piece)
                at += len(piece)
            sent = 0
            digest = hasher(self.digest, self.hash_thread)  # beside the reads (after a resume's prefix)
            try:
                while True:
                    piece = os.pread(fd, CHUNK_BYTES, at)
                    if not piece:
                        break
                    digest.update(piece)
                    at += len(piece)
                    sent += len(piece)
                    self._chunk(piece)
                now = os.fstat(fd)
                sha256 = digest.hexdigest()
            finally:
                digest.close()
        if (now.st_size, now.st_mtime_ns) != (st.st_size, st.st_mtime_ns) or at != st.st_size:
            raise StreamError("%s changed during the download (%d bytes when it started, %d now)"
                              % (shown, st.st_size, now.st_size))
        self._put(("end", {"eof": True, "files": 1, "size": at, "bytes": sent,
                           "sha256": sha256, "path": shown}))


class _Chunker:
    """A file object for :func:`tarstream.pack` that sends what it is given in chunks of
    :data:`CHUNK_BYTES` (waiting while :data:`READ_AHEAD` are unsent)."""

    def __init__(self, stream):
        self.stream = stream
        self.buf = bytearray()
        self.sent = 0

    def write(self, data):
        self.buf += data
        while len(self.buf) >= CHUNK_BYTES:
            self._send(bytes(self.buf[:CHUNK_BYTES]))
            del self.buf[:CHUNK_BYTES]
        return len(data)

    def flush(self):
        if self.buf:
            self._send(bytes(self.buf))
            self.buf = bytearray()

    def _send(self, chunk):
        self.stream.digest.update(chunk)
        self.sent += len(chunk)
        self.stream._chunk(chunk)
