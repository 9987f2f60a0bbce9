"""The ``upload`` and ``download`` ops: a file, or a directory as a tar stream, into or out
of a slot, in binary frames (the agent's side of ``hermes_modal_tool/filetransfer.py``).

Stdlib-only, Python 3.8.

Each stream has a thread of its own (never one of the ``files`` workers the file tools
of every slot share, never the event loop): it opens the target the way the file tools
do (:class:`.files.Workspace`: from the slot's root, no link the slot made leads out,
with the slot's filesystem credentials, files given to the slot's uid), then writes the
chunks the host sends to that descriptor, or reads the file into chunks, and keeps the
SHA-256 of what passed. A directory goes through :mod:`.tarstream` relative to the
directory's descriptor. On the loop a chunk costs a dict and a queue put: the bytes
come in a binary frame (``protocol``: no base64, no JSON), so a transfer never stalls
the loop that serves the other slots.

Flow control and memory: an upload chunk is answered once written, so the host's
window bounds what waits; a download reads at most :data:`READ_AHEAD` chunks ahead of
the host's requests. A slot's reset or the agent's shutdown aborts its streams
(:func:`drop_slot`, :func:`drop_all`).
"""

import collections
import errno
import hashlib
import itertools
import os
import queue
import stat
import threading

from . import files, tarstream

#: Bytes per download chunk (the host sends upload chunks of its own size).
CHUNK_BYTES = 1024 * 1024
#: Download chunks read ahead of the host's requests, per stream.
READ_AHEAD = 4
#: Streams open at once per sandbox (each holds a thread and a descriptor).
MAX_STREAMS = 64
_ids = itertools.count(1)


class StreamError(Exception):
    """A transfer the agent refuses or cannot finish; the message goes to the host."""


def _streams(agent):
    s = getattr(agent, "file_streams", None)
    if s is None:
        s = agent.file_streams = {}
    return s


def dispatch(agent, msg):
    """Serve an ``upload`` or ``download`` message (see ``protocol``)."""
    mid = msg.get("id")
    try:
        sid = msg.get("stream")
        if sid is None:
            _open(agent, msg)
            return
        stream = _streams(agent).get(sid)
        if stream is None or stream.op != msg.get("op"):
            if msg.get("abort"):
                agent.send({"id": mid, "ok": True, "result": {}})
                return
            raise StreamError("no %s stream %r" % (msg.get("op"), sid))
        stream.request(msg)
    except Exception as exc:  # noqa: BLE001 - reported to the host
        agent.send({"id": mid, "ok": False, "error": _text(exc)})


def _open(agent, msg):
    op = msg.get("op")
    slot = agent.slots.get(msg.get("slot"))
    path = msg.get("path")
    offset = msg.get("offset") or 0
    kind = msg.get("kind") or "file"
    if slot is None or not isinstance(path, str) or not path or "\x00" in path:
        raise StreamError("%s needs a slot of this sandbox and a path, got slot %r path %r"
                          % (op, msg.get("slot"), path))
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise StreamError("offset must be a whole number of bytes >= 0, got %r" % (offset,))
    if op == "upload" and kind not in ("file", "tar"):
        raise StreamError("upload kind must be 'file' or 'tar', got %r" % (kind,))
    streams = _streams(agent)
    if len(streams) >= MAX_STREAMS:
        raise StreamError("%d transfers are open in this sandbox already; finish one first" % MAX_STREAMS)
    slot.prepare_dirs()  # cheap (the layered root is built in the stream's thread)
    slot.dirty = True  # a reset must drop what an upload wrote (and the root a download built)
    sid = "%s%d" % ("u" if op == "upload" else "d", next(_ids))
    stream = (_Upload if op == "upload" else _Download)(agent, slot, sid, msg, kind, offset)
    streams[sid] = stream
    stream.thread.start()


def drop_slot(agent, index):
    """Abort the streams of slot ``index`` (its reset): their threads close their files."""
    streams = _streams(agent)
    for sid, stream in list(streams.items()):
        if stream.slot.index == index:
            stream.abort()
            if stream.op == "download":
                del streams[sid]


def drop_all(agent):
    """Abort every stream (the agent shuts down)."""
    for stream in list(_streams(agent).values()):
        stream.abort()


def _text(exc):
    if isinstance(exc, (StreamError, files.FileToolError, tarstream.TarRefused)):
        return str(exc)
    if isinstance(exc, OSError):
        return "%s%s" % (exc.strerror or exc, ": %s" % exc.filename if isinstance(exc.filename, str) else "")
    return "%s: %s" % (type(exc).__name__, exc)


class _Stream:
    op = ""

    def __init__(self, agent, slot, sid, msg, kind, offset):
        self.agent = agent
        self.slot = slot
        self.sid = sid
        self.open_id = msg.get("id")
        self.path = msg["path"]
        self.kind = kind
        self.offset = offset
        self.expect_prefix = msg.get("sha256")
        self.digest = hashlib.sha256()
        self.aborted = False
        self.thread = threading.Thread(target=self._run, name="hermes-modal-tool-" + sid, daemon=True)

    def reply(self, mid, result=None, error=None, blob=None):
        """Answer request ``mid`` (from any thread)."""
        msg = {"id": mid, "ok": error is None}
        if error is not None:
            msg["error"] = error
        else:
            msg["result"] = result if result is not None else {}
        if blob is not None:
            msg["blob"] = blob
        self.agent.loop.call_soon_threadsafe(self.agent.send, msg)

    def forget(self):
        """Drop the stream (on the loop)."""
        self.agent.loop.call_soon_threadsafe(_streams(self.agent).pop, self.sid, None)

    def _run(self):
        try:
            files.preload()  # imports read the agent's own files: not as the slot
            self.slot.ensure_root()
            with self.slot.fs_creds():
                self.serve()
        except BaseException as exc:  # noqa: BLE001 - reported to the host
            self.failed(exc)
        finally:
            self.forget()

    def _open_dir(self, create):
        """A descriptor of the slot's directory ``path`` (made, with parents, when
        ``create``), resolved by the workspace's walk (never through a link that leads out)."""
        ws = self.slot.workspace
        dir_fd, name, shown = ws.walk(self.path, create_parents=create)
        try:
            if name is None:
                return os.dup(dir_fd), shown
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=dir_fd)
                    ws._own(name, dir_fd)
                except FileExistsError:
                    pass
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                             dir_fd=dir_fd)
            except FileNotFoundError:
                raise StreamError("no such file or directory: %s" % shown) from None
            except OSError as exc:
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                    raise StreamError("%s is not a directory" % shown) from None
                raise
            try:
                ws._check_owner(os.fstat(fd), shown)
            except BaseException:
                os.close(fd)
                raise
            return fd, shown
        finally:
            os.close(dir_fd)


class _Upload(_Stream):
    op = "upload"

    def __init__(self, *args):
        super().__init__(*args)
        self.items = queue.Queue()  # ("data", mid, blob) / ("end", mid) / ("abort", mid)
        self.error = None
        self.taken = None  # the request whose chunk is being written (unanswered)
        self.end_id = None  # the end request, once taken

    def request(self, msg):
        mid = msg.get("id")
        if msg.get("abort"):
            self.abort(mid)
        elif msg.get("end"):
            self.items.put(("end", mid, None))
        else:
            blob = msg.get("blob")
            if not isinstance(blob, bytes):
                raise StreamError("an upload chunk must come in a binary frame")
            self.items.put(("data", mid, blob))

    def abort(self, mid=None):
        self.aborted = True
        self.items.put(("abort", mid, None))

    def failed(self, exc):
        self.error = _text(exc)
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
                self.reply(mid, {"written": written})
        finally:
            os.close(fd)
        self.reply(mid, {"size": self.offset + written, "bytes": written, "files": 1, "path": shown,
                         "sha256": self.digest.hexdigest()})

    def _owner(self):
        ws = self.slot.workspace
        return (ws.uid, ws.gid) if ws.uid is not None else None

    def _open_file(self):
        """The slot's file, open for writing as ``write_file`` opens it (no link followed,
        a FIFO never blocks, a file of another owner refused); emptied, or for a resume
        checked to hold exactly the ``offset`` bytes the host has (by SHA-256)."""
        ws = self.slot.workspace
        dir_fd, name, shown = ws.walk(self.path, create_parents=True)
        try:
            if name is None:
                raise StreamError("%s is a directory" % shown)
            flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            created = False
            try:
                try:
                    if self.offset:
                        raise FileExistsError
                    fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd)
                    created = True
                except FileExistsError:
                    fd = os.open(name, flags, dir_fd=dir_fd)
            except IsADirectoryError:
                raise StreamError("%s is a directory" % shown) from None
            except FileNotFoundError:
                raise StreamError("cannot resume at offset %d: no file %s" % (self.offset, shown)) from None
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    raise StreamError("%s is not a regular file" % shown) from None
                raise StreamError("cannot write %s: %s" % (shown, exc.strerror)) from None
        finally:
            os.close(dir_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StreamError("%s is not a regular file" % shown)
            if not created:
                ws._check_owner(st, shown)
            os.set_blocking(fd, True)
            if self.offset:
                self._check_prefix(fd, st.st_size, shown)
                os.lseek(fd, self.offset, os.SEEK_SET)
            else:
                os.ftruncate(fd, 0)
            if ws.uid is not None:
                os.fchown(fd, ws.uid, ws.gid)
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


class _Download(_Stream):
    op = "download"

    def __init__(self, *args):
        super().__init__(*args)
        self.room = threading.Semaphore(READ_AHEAD)  # chunks read and not yet sent
        self.ready = collections.deque()  # ("data", bytes) / ("end", result) / ("error", text)
        self.waiting = collections.deque()  # request ids with no chunk yet
        self.final = None  # the last reply, repeated to requests past the end

    # -- on the loop ---------------------------------------------------------------
    def request(self, msg):
        mid = msg.get("id")
        if msg.get("abort"):
            self.abort()
            _streams(self.agent).pop(self.sid, None)
            self.agent.send({"id": mid, "ok": True, "result": {}})
            return
        self.waiting.append(mid)
        self._pair()

    def _offer(self, item):
        self.ready.append(item)
        self._pair()

    def _pair(self):
        while self.waiting and (self.ready or self.final is not None):
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
            self.reply(self.open_id, error=_text(exc))
        elif not self.aborted:
            self._put(("error", _text(exc)))

    def forget(self):
        pass  # the host's closing request drops it (it may still ask past the end)

    def serve(self):
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
            fd, shown = self._open_dir(create=False)
            try:
                self.reply(self.open_id, {"stream": self.sid, "kind": "dir", "path": shown})
                self.open_id = None
                out = _Chunker(self)
                made, size, skipped = tarstream.pack(fd, out, ws.uid)
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
            while True:
                piece = os.pread(fd, CHUNK_BYTES, at)
                if not piece:
                    break
                self.digest.update(piece)
                at += len(piece)
                sent += len(piece)
                self._chunk(piece)
            now = os.fstat(fd)
        if (now.st_size, now.st_mtime_ns) != (st.st_size, st.st_mtime_ns) or at != st.st_size:
            raise StreamError("%s changed during the download (%d bytes when it started, %d now)"
                              % (shown, st.st_size, now.st_size))
        self._put(("end", {"eof": True, "files": 1, "size": at, "bytes": sent,
                           "sha256": self.digest.hexdigest(), "path": shown}))


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
