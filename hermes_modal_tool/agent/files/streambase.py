"""What the ``upload`` and ``download`` streams share (see :mod:`.streams`): a stream's
thread, its replies, and how the slot's directory is opened.

Stdlib-only, Python 3.8.
"""

import errno
import hashlib
import os
import threading

from . import files, tarstream

#: Bytes per download chunk (the host sends upload chunks of its own size).
CHUNK_BYTES = 256 * 1024
#: Download chunks read ahead of the host's requests, per stream.
READ_AHEAD = 4
#: Streams open at once per sandbox (each holds a thread and a descriptor).
MAX_STREAMS = 64
#: Names in a resumed directory transfer's list (``Stream.listing``).
MAX_LISTED = 1000000


class StreamError(Exception):
    """A transfer the agent refuses or cannot finish; the message goes to the host."""


def streams_of(agent):
    """The agent's open transfer streams, by id."""
    s = getattr(agent, "file_streams", None)
    if s is None:
        s = agent.file_streams = {}
    return s


def text_of(exc):
    """What the host is told of ``exc``."""
    if isinstance(exc, (StreamError, files.FileToolError, tarstream.TarRefused)):
        return str(exc)
    if isinstance(exc, OSError):
        return "%s%s" % (exc.strerror or exc, ": %s" % exc.filename if isinstance(exc.filename, str) else "")
    return "%s: %s" % (type(exc).__name__, exc)


class Stream:
    """One transfer: its thread, its slot, the SHA-256 of what passed."""

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
        # A resumed directory's list (JSON lines, ``treesums``): names the host has; parsed
        # in the stream's thread, never on the loop.
        self.listing = msg.get("blob") if isinstance(msg.get("blob"), (bytes, bytearray)) else None
        self.meta = msg.get("meta")  # an upload's file: [mode, mtime] set at its end
        # A file's SHA-256 in a thread of its own (True), in this one (False), or as the
        # agent's cores allow (None: ``hashthread.hasher``).
        self.hash_thread = msg.get("hash_thread") if isinstance(msg.get("hash_thread"), bool) else None
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
        self.agent.loop.call_soon_threadsafe(streams_of(self.agent).pop, self.sid, None)

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
