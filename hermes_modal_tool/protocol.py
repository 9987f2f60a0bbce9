"""The host <-> in-sandbox agent protocol: one definition, used by both ends.

This module is stdlib-only and runs on Python 3.8, because the in-sandbox agent
imports it inside images we do not control.

Framing: every message is one frame, a 4-byte big-endian payload length followed
by that many bytes of UTF-8 JSON (one object). A message with raw bytes (a chunk of a
file transfer) is a *binary frame*: the length word has its top bit set
(:data:`BINARY_FLAG`; a plain frame's length is below :data:`MAX_FRAME_BYTES`, so the
bit was never set before, and a decoder without binary frames refuses it as too long),
and its payload is a 4-byte big-endian JSON length, that JSON object, then the bytes,
which the decoder hands back as the message's ``"blob"`` (``bytes``, or for a large frame that came
in pieces the ``bytearray`` it was assembled in: no copy); :func:`encode`
makes one for a message whose ``"blob"`` is bytes-like. No base64, no JSON escaping. All slots of a sandbox share one
stream in each direction; requests carry an ``id`` and the response to a request
carries the same ``id``, so responses may arrive in any order.

Requests (host -> agent), every one with ``{"id": int, "op": str}``:

``init``      ``{"config": {...}}``: first message; the agent answers with its
              capabilities (python version, isolation, limit mode).
``call``      ``{"slot": int, "tool": str, "args": {...}, "timeout": float}``: run one
              tool call in a slot. Calls to one slot run one at a time, in arrival
              order; calls to different slots run concurrently. A ``bash`` call's
              timeout (``args["timeout"]``, else ``timeout``) is its command's own run
              time: the clock starts when the command is handed to the slot's shell,
              after the call has waited (1) for earlier calls of its slot, (2) for
              the slot's shell to start, and (3) for admission: a sandbox whose CPU
              is taken (by commands that compute, not by ones that sleep or wait on
              I/O) queues further commands, first come first served (see
              ``hermes_modal_tool/agent/limits/admission.py``).
``calls``     ``{"calls": [[id, slot, tool, args, timeout], ...]}`` with id 0: several
              ``call`` requests in one frame (a batch's calls to one sandbox; the host
              sends them so), each with its own id; each is handled as that ``call``.
              Their responses come in ``results`` frames (below).
``reset``     ``{"slot": int}``: kill the slot's shell and every process it started,
              empty its workspace. The next call gets a fresh shell.
``cancel``    ``{"target": int}``: stop the call with id ``target`` (kills what it
              started); the cancelled call still gets its own response.
``status``    ``{}``: per-slot state, for diagnostics.
``shutdown``  ``{}``: kill every slot, remove what the agent created, answer, exit.
``snapshot``  ``{"slot": int, "cap_bytes": int?}``: freeze the slot's layer and shell state
              (see ``hermes_modal_tool/agent/state/snapshots.py``); the slot goes on from it.
              Result ``{"snapshot": id, "size_bytes", "depth", "total_bytes"}``.
``fork``      ``{"slot": int, "snapshot": id}``: a free slot starts from a snapshot.
``release_snapshot`` ``{"snapshot": id}``: drop one hold (freed with its last user).
``snapshots`` ``{}``: the sandbox's snapshots, sizes and reference counts.
``export_snapshot`` / ``import_snapshot``: a snapshot as a tar stream, in chunks.
``ping``      ``{}`` with id 0: the owner is alive (Modal's heartbeat); no answer.
``process``   ``{"slot": int, "action": str, "process": int, ...}``: a slot's processes
              (a ``bash`` call with ``pty: true`` starts one; see
              ``hermes_modal_tool/agent/shells/ptyprocs.py``).
``usage``     ``{"slot": int}``: what the slot's tenant (since its last reset) used: result
              ``{"source", "cpu_user_s", "cpu_system_s", "memory_peak_bytes", "disk_bytes",
              "disk_peak_bytes", "notes"}`` (see ``hermes_modal_tool/agent/limits/usage.py``).
``checksum``  ``{"slot": int, "path": str, "prefix"?}``: the file's ``{"sha256", "size", "path"}``
              (and ``prefix_sha256``, of its first ``prefix`` bytes), read through the slot's
              view (``agent/files/filesums.py``; streamed transfer checks, a file's resume).
``upload``    ``{"slot": int, "path": str, "kind": "file"|"tar", "offset"?, "sha256"?, "meta"?,
              "hash_thread"?}``: open a
              stream into the slot (``agent/files/streams.py``; a file's SHA-256 in a thread
              of its own with ``hash_thread`` true, in the writer's with false, absent: as
              the agent's cores allow, ``agent/files/hashthread.py``), result ``{"stream"}``; then
              ``{"stream", "blob"}`` per chunk (binary frames, answered once written, or
              on arrival while 2 MiB or less wait to be written) and
              ``{"stream", "end": true}`` (result: ``size``, ``sha256``, ``files``, ``bytes``)
              or ``{"stream", "abort": true}``.
``download``  ``{"slot": int, "path": str, "offset"?, "kind"?, "hash_thread"?}``: open a stream out of the slot (a
              file, or a directory as a tar; with a binary frame, JSON lines of names left
              out of the tar), or ``kind: "manifest"``: a directory's files with sizes and
              SHA-256 (``agent/files/treesums.py``; a resume), result ``{"stream", "kind"}``; then ``{"stream"}``
              per chunk, answered by a binary frame (``eof``, and at the end ``size``,
              ``sha256``, ``files``, ``skipped``), or ``{"stream", "abort": true}``.
``tunnel``    ``{"slot": int, "port": int}``: a TCP connection to ``127.0.0.1:port`` made by the
              agent in the slot's network namespace (``agent/net/tunnels.py``; previews),
              result ``{"tunnel"}``; then ``{"tunnel", "blob"}`` (binary frames, answered once
              the socket has room), ``{"tunnel", "read": true}`` (answered by a binary frame
              of at most 64 KiB, ``eof``; empty with ``idle`` after 20 s without data),
              ``{"tunnel", "end": true}`` (half-close) or ``{"tunnel", "close": true}``.
``ack``       ``{"bytes": int}`` with id 0: the host received that much streamed output
              (see ``output`` below); no answer.

A ``call`` with ``"stream": true`` has its output sent while it runs, as events
``{"id": 0, "event": "output", "target": id, "chunks": [[1 or 2, str], ...], "b64"?}``
(1 stdout, 2 stderr; base64 with ``encoding: "bytes"``), all before its response
(``hermes_modal_tool/agent/shells/streaming.py``: the bounds per slot and per sandbox).

Responses (agent -> host): ``{"id": int, "ok": bool, "error": str?, "result": {...}}``.
For ``call`` the result has the keys of :data:`RESULT_KEYS`. Calls that came in a
``calls`` frame are answered in ``{"id": 0, "results": [[id, result], ...]}`` frames
instead (the results of one batch that are ready together, one frame; ``ok`` is true),
each result without the keys whose value is the default (``error`` None, ``timed_out``
and ``truncated`` false, ``data`` empty: :func:`compact_result`).

Events (agent -> host, no response expected): ``{"id": 0, "event": str, "target": int}``.
``queued``: call ``target`` has waited a while (5 s, or half its timeout when that
is shorter) and has not started yet; ``started``: its command started (sent only
after ``queued``). The host does not count the wait between them against the call.
"""

import json
import struct

# The tools and their argument checks (toolargs.py), part of the protocol's surface.
from .toolargs import MAX_TIMEOUT_S, TOOL_ARGS, TOOLS, check_args  # noqa: F401

PROTOCOL_VERSION = 1

HEADER = struct.Struct(">I")
#: Largest frame either side accepts (bytes). A bigger frame is a protocol error.
MAX_FRAME_BYTES = 256 * 1024 * 1024
#: Frames of this many bytes, up to MAX_WHOLE_BYTES, that come in pieces are assembled in a
#: buffer of their own size (``FrameDecoder.feed``); a longer one grows as it comes.
WHOLE_FRAME_BYTES, MAX_WHOLE_BYTES = 64 * 1024, 16 * 1024 * 1024
#: Top bit of a frame's length word: a binary frame (see the module doc).
BINARY_FLAG = 0x80000000
_JSON_LEN = struct.Struct(">I")

OPS = ("init", "call", "calls", "reset", "cancel", "status", "shutdown", "snapshot", "fork",
       "release_snapshot", "snapshots", "export_snapshot", "import_snapshot", "ping", "ack", "process", "usage",
       "checksum", "upload", "download", "tunnel")

#: Keys of a ``call`` result.
RESULT_KEYS = ("output", "error", "returncode", "timed_out", "truncated", "duration_s", "data")
#: Keys a ``bash`` result has besides: ``stdout`` and ``stderr`` (texts, capped like
#: ``output``) only when the command wrote to stderr (else ``output`` is its stdout);
#: ``stdout_b64``, ``stderr_b64`` (each stream's first ``output_limit`` bytes, exact)
#: and ``stdout_bytes``, ``stderr_bytes`` (the bytes each wrote) with ``encoding: "bytes"``.
STREAM_KEYS = ("stdout", "stderr", "stdout_b64", "stderr_b64", "stdout_bytes", "stderr_bytes")

#: Exit code reported for a command stopped by its timeout (as GNU ``timeout`` does).
TIMEOUT_EXIT_CODE = 124


class ProtocolError(Exception):
    """Raised when a frame cannot be decoded (bad length, bad JSON, not an object)."""


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _fast_codec():
    """The ``json`` module's C encoder and scanner, made once, where this Python has
    them and they agree with ``json`` on a sample: ``(encode, scan)``, either None.

    ``json.dumps`` and ``json.loads`` make an encoder per call and pass through three
    Python frames each: about 1 µs of the 3 µs a small message costs, twice per call on
    each side. The encoder skips the circular-reference check (a cycle raises
    RecursionError instead of ValueError; both become ProtocolError)."""
    sample = {"id": 1, "s": "\u00e9\n\"", "f": 0.25, "n": None, "b": [True, False], "d": {}}
    encode_c = scan = None
    try:
        from json.encoder import c_make_encoder, encode_basestring
        if c_make_encoder is not None:
            encode_c = c_make_encoder(None, _ENCODER.default, encode_basestring, None, ":", ",",
                                      False, False, True)
            if "".join(encode_c(sample, 0)) != _ENCODER.encode(sample):
                encode_c = None
    except Exception:  # noqa: BLE001 - another Python's internals: use the public API
        encode_c = None
    try:
        from json.scanner import c_make_scanner
        if c_make_scanner is not None:
            scan = c_make_scanner(json.JSONDecoder())
            text = _ENCODER.encode(sample)
            if scan(text, 0) != (sample, len(text)):
                scan = None
    except Exception:  # noqa: BLE001 - as above
        scan = None
    return encode_c, scan


_ENCODE_C, _SCAN = _fast_codec()


def _dumps(message):
    if _ENCODE_C is not None:
        return "".join(_ENCODE_C(message, 0))
    return _ENCODER.encode(message)


def _loads(payload):
    """``json.loads`` of one payload (bytes, or any bytes-like object: decoded straight
    from it), through the C scanner when it takes the whole of it (anything else goes
    the slow way, for the same result or error)."""
    text = str(payload, "utf-8", "surrogatepass")
    if _SCAN is not None:
        try:
            value, end = _SCAN(text, 0)
        except (StopIteration, ValueError):
            pass
        else:
            if end == len(text):
                return value
    return json.loads(text)


def encode(message):
    """Return the frame (bytes) for one message (a JSON-serialisable dict).

    Raises ProtocolError for anything else (not a dict, or values JSON cannot hold).
    """
    if not isinstance(message, dict):
        raise ProtocolError("a message must be a JSON object, got %s" % type(message).__name__)
    blob = message.get("blob")
    if blob is not None and isinstance(blob, (bytes, bytearray, memoryview)):
        return _encode_binary(message, blob)
    try:
        payload = _dumps(message).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError, RecursionError) as exc:
        raise ProtocolError("message cannot be sent as JSON: %s" % exc) from None
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(
            "message of %d bytes exceeds the %d byte frame limit" % (len(payload), MAX_FRAME_BYTES)
        )
    return HEADER.pack(len(payload)) + payload


def _encode_binary(message, blob):
    """A binary frame: the message less its ``blob`` as JSON, then the blob's bytes."""
    head = dict(message)
    del head["blob"]
    try:
        text = _dumps(head).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError, RecursionError) as exc:
        raise ProtocolError("message cannot be sent as JSON: %s" % exc) from None
    size = 4 + len(text) + len(blob)
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(
            "message of %d bytes exceeds the %d byte frame limit" % (size, MAX_FRAME_BYTES))
    return b"".join((HEADER.pack(size | BINARY_FLAG), _JSON_LEN.pack(len(text)), text, blob))


def decode_payload(payload):
    """Decode one frame's payload (bytes or a bytes-like object) into a dict; raise
    ProtocolError if it is not one."""
    try:
        message = _loads(payload)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError("undecodable frame: %s" % exc) from None
    if not isinstance(message, dict):
        raise ProtocolError("frame is not a JSON object: %r" % (type(message).__name__,))
    return message


def _decode_binary(buf, start, end):
    """The message of a binary frame's payload ``buf[start:end]``, with its ``blob``."""
    if end - start < 4:
        raise ProtocolError("binary frame of %d bytes has no JSON length" % (end - start))
    (text_len,) = _JSON_LEN.unpack_from(buf, start)
    if text_len > end - start - 4:
        raise ProtocolError("binary frame's JSON length %d passes its end" % text_len)
    cut = start + 4 + text_len
    message = decode_payload(bytes(buf[start + 4 : cut]))
    if "blob" in message:
        raise ProtocolError("a binary frame's JSON must not have a 'blob' key")
    view = memoryview(buf)
    try:
        message["blob"] = bytes(view[cut:end])  # one copy, out of the buffer
    finally:
        view.release()
    return message


def _decode_whole(whole):
    """The message of binary frame ``whole`` (a bytearray, length word included); its
    ``blob`` is ``whole`` cut to the blob's bytes (no copy: a bytearray's front is cut in place)."""
    if len(whole) < 8:
        raise ProtocolError("binary frame of %d bytes has no JSON length" % (len(whole) - 4))
    (text_len,) = _JSON_LEN.unpack_from(whole, 4)
    if text_len > len(whole) - 8:
        raise ProtocolError("binary frame's JSON length %d passes its end" % text_len)
    message = decode_payload(bytes(whole[8:8 + text_len]))
    if "blob" in message:
        raise ProtocolError("a binary frame's JSON must not have a 'blob' key")
    del whole[:8 + text_len]
    message["blob"] = whole
    return message


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, get complete messages back.

    Example:
        >>> d = FrameDecoder()
        >>> frame = encode({"id": 1, "op": "status"})
        >>> d.feed(frame[:3])
        []
        >>> d.feed(frame[3:])
        [{'id': 1, 'op': 'status'}]
    """

    __slots__ = ("_buffer", "_whole", "_filled")

    def __init__(self):
        self._buffer = bytearray()
        self._whole = None  # a large frame being assembled: its bytes, made at its full size
        self._filled = 0

    def feed(self, data):
        """Add bytes; return the list of messages completed by them (maybe empty).

        A large frame (a transfer's chunk) that comes in pieces is copied once into a
        buffer of its size, made when its length word arrives (before: three copies and a
        move; the host's loop spent a fifth of a download in them)."""
        whole = self._whole
        if whole is None:
            return self._feed(data)
        at = self._filled
        n = min(len(whole) - at, len(data))
        view = memoryview(data)
        try:
            whole[at:at + n] = view[:n]
            self._filled = at + n
            if self._filled < len(whole):
                return []
            self._whole = None
            if HEADER.unpack_from(whole, 0)[0] & BINARY_FLAG:
                messages = [_decode_whole(whole)]
            else:
                frame = memoryview(whole)
                try:
                    messages = [decode_payload(frame[4:])]
                finally:
                    frame.release()
            if n < len(data):
                messages.extend(self._feed(view[n:]))
            return messages
        finally:
            view.release()

    def _feed(self, data):
        """:meth:`feed` while no large frame is being assembled.

        Whole frames are decoded straight from ``data`` (one copy, into the text the
        JSON scanner reads); only an incomplete frame's bytes are kept for the next
        call, and once they complete it they are decoded straight from that buffer
        (before, the buffer was first copied whole: one more copy of every large frame,
        which always comes in several reads). Before that, every read was appended to
        the buffer and each payload copied twice more (a slice, then ``bytes``)."""
        buf = self._buffer
        kept = False  # decoding from ``buf`` itself (its consumed front is cut at the end)
        if buf:
            buf += data
            if len(buf) < 4:
                return []
            (length,) = HEADER.unpack_from(buf, 0)
            length &= ~BINARY_FLAG
            if length <= MAX_FRAME_BYTES and len(buf) < 4 + length:
                if WHOLE_FRAME_BYTES <= length <= MAX_WHOLE_BYTES:
                    self._keep(buf, 0, True)  # its length word is here now: assemble it whole
                return []  # the frame is still incomplete: nothing copied (a large frame comes in many reads)
            data = buf
            kept = True
        messages = []
        start = 0
        size = len(data)
        view = memoryview(data)
        try:
            while size - start >= 4:
                (length,) = HEADER.unpack_from(data, start)
                binary = length & BINARY_FLAG
                length &= ~BINARY_FLAG
                if length > MAX_FRAME_BYTES:
                    raise ProtocolError(
                        "frame length %d exceeds the %d byte limit" % (length, MAX_FRAME_BYTES)
                    )
                end = start + 4 + length
                if end > size:
                    break
                if binary:
                    messages.append(_decode_binary(view, start + 4, end))
                else:
                    messages.append(decode_payload(view[start + 4 : end]))
                start = end
        except ProtocolError:
            view.release()
            self._keep(data, start, kept)  # as before: the bad frame stays at the front
            raise
        view.release()
        self._keep(data, start, kept)
        return messages

    def _keep(self, data, start, kept):
        """Keep ``data[start:]`` (an incomplete frame) for the next :meth:`feed` (a large
        one whose length word is here: in a buffer of its size)."""
        rest = len(data) - start
        if rest >= 4:
            (length,) = HEADER.unpack_from(data, start)
            length &= ~BINARY_FLAG
            if WHOLE_FRAME_BYTES <= length <= MAX_WHOLE_BYTES and rest < 4 + length:
                whole = bytearray(4 + length)
                view = memoryview(data)
                try:
                    whole[:rest] = view[start:]
                finally:
                    view.release()
                self._whole, self._filled = whole, rest
                if kept:
                    self._buffer = bytearray()
                return
        if kept:
            try:
                del self._buffer[:start]
            except BufferError:  # a view of it lives on (in a decode error's traceback)
                self._buffer = self._buffer[start:]
        elif start < len(data):
            self._buffer += data[start:]

    @property
    def pending(self):
        """Number of buffered bytes that do not yet form a whole frame."""
        return len(self._buffer) + (self._filled if self._whole is not None else 0)


def call_result(
    output="",
    error=None,
    returncode=None,
    timed_out=False,
    truncated=False,
    duration_s=0.0,
    data=None,
):
    """Build a ``call`` result dict with every key of :data:`RESULT_KEYS`."""
    return {
        "output": output,
        "error": error,
        "returncode": returncode,
        "timed_out": timed_out,
        "truncated": truncated,
        "duration_s": duration_s,
        "data": data if data is not None else {},
    }


#: Keys of a ``call`` result left out of a ``results`` frame when they have this value.
_DEFAULTS = (("error", None), ("timed_out", False), ("truncated", False))


def compact_result(result):
    """``result`` (a ``call`` result) less its keys that hold their default value (see
    ``results`` in the module doc); a new dict, or ``result`` itself when none does."""
    drop = [k for k, v in _DEFAULTS if k in result and result[k] is v]
    if "data" in result and not result["data"]:
        drop.append("data")
    if not drop:
        return result
    return {k: v for k, v in result.items() if k not in drop}
