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

Flow control and memory: a file upload's chunk is answered as it arrives while less
than ``streamin.AHEAD_BYTES`` (2 MiB) wait to be written, else once written (a tar
stream's, once read), so the host's window and that bound what waits; a download reads at most :data:`READ_AHEAD` chunks ahead of
the host's requests. A slot's reset or the agent's shutdown aborts its streams
(:func:`drop_slot`, :func:`drop_all`).
"""

import itertools

from .streambase import MAX_STREAMS, StreamError, streams_of, text_of
from .streamin import Upload
from .streamout import Download
from .streamprobe import Probe

_ids = itertools.count(1)


def dispatch(agent, msg):
    """Serve an ``upload`` or ``download`` message (see ``protocol``)."""
    mid = msg.get("id")
    try:
        sid = msg.get("stream")
        if sid is None:
            _open(agent, msg)
            return
        stream = streams_of(agent).get(sid)
        if stream is None or stream.op != msg.get("op"):
            if msg.get("abort"):
                agent.send({"id": mid, "ok": True, "result": {}})
                return
            raise StreamError("no %s stream %r" % (msg.get("op"), sid))
        stream.request(msg)
    except Exception as exc:  # noqa: BLE001 - reported to the host
        agent.send({"id": mid, "ok": False, "error": text_of(exc)})


def _open(agent, msg):
    op = msg.get("op")
    slot = agent.slots.get(msg.get("slot"))
    path = msg.get("path")
    offset = msg.get("offset") or 0
    kind = msg.get("kind") or "file"
    if kind == "probe":  # the stream's own speed, no file (streamprobe.py)
        _open_probe(agent, msg, op, slot)
        return
    if slot is None or not isinstance(path, str) or not path or "\x00" in path:
        raise StreamError("%s needs a slot of this sandbox and a path, got slot %r path %r"
                          % (op, msg.get("slot"), path))
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise StreamError("offset must be a whole number of bytes >= 0, got %r" % (offset,))
    if op == "upload" and kind not in ("file", "tar"):
        raise StreamError("upload kind must be 'file' or 'tar', got %r" % (kind,))
    if op == "download" and kind not in ("file", "manifest"):
        raise StreamError("download kind must be 'file' or 'manifest', got %r" % (kind,))
    meta = msg.get("meta")
    if meta is not None and not (isinstance(meta, list) and len(meta) == 2 and kind == "file" and op == "upload"
                                 and all(isinstance(v, int) and not isinstance(v, bool) for v in meta)):
        raise StreamError("meta must be [mode, mtime] (whole numbers) of an uploaded file, got %r" % (meta,))
    streams = streams_of(agent)
    if len(streams) >= MAX_STREAMS:
        raise StreamError("%d transfers are open in this sandbox already; finish one first" % MAX_STREAMS)
    slot.prepare_dirs()  # cheap (the layered root is built in the stream's thread)
    slot.dirty = True  # a reset must drop what an upload wrote (and the root a download built)
    sid = "%s%d" % ("u" if op == "upload" else "d", next(_ids))
    stream = (Upload if op == "upload" else Download)(agent, slot, sid, msg, kind, offset)
    streams[sid] = stream
    stream.thread.start()


def _open_probe(agent, msg, op, slot):
    size = msg.get("size") or 0
    if slot is None or isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise StreamError("a %s probe needs a slot of this sandbox and a size >= 0, got slot %r size %r"
                          % (op, msg.get("slot"), msg.get("size")))
    streams = streams_of(agent)
    if len(streams) >= MAX_STREAMS:
        raise StreamError("%d transfers are open in this sandbox already; finish one first" % MAX_STREAMS)
    sid = "p%d" % next(_ids)
    streams[sid] = Probe(agent, slot, sid, op, size)
    agent.send({"id": msg.get("id"), "ok": True, "result": {"stream": sid, "kind": "probe"}})


#: Bytes of the agent's stdin and stdout pipes (Linux's ``F_SETPIPE_SZ``; 64 KiB by default).
PIPE_BYTES = 1024 * 1024
F_SETPIPE_SZ = 1031


def widen_pipes(*fds):
    """Make the protocol's pipes hold :data:`PIPE_BYTES` where the kernel lets this process
    (a chunk of a transfer then takes one wakeup of each end, not sixteen); a descriptor
    that is no pipe, or a refusal (``/proc/sys/fs/pipe-max-size``), leaves it as it is."""
    import fcntl

    for fd in fds:
        try:
            fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass


def drop_slot(agent, index):
    """Abort the streams of slot ``index`` (its reset): their threads close their files."""
    streams = streams_of(agent)
    for sid, stream in list(streams.items()):
        if stream.slot.index == index:
            stream.abort()
            if stream.op == "download" or isinstance(stream, Probe):
                del streams[sid]


def drop_all(agent):
    """Abort every stream (the agent shuts down)."""
    for stream in list(streams_of(agent).values()):
        stream.abort()
