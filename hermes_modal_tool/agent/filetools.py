"""The file tools' entry points: ``(workspace, args, output_limit) -> (output, data)``.

Stdlib-only, Python 3.8. Paths are resolved by :class:`.files.Workspace`; every buffer a
call holds is bounded by its caps (``limit``/``max_bytes``, the output cap).
"""

import base64

from .files import MAX_READ_BYTES, READ_CHUNK, FileToolError

# -- tool entry points: (workspace, args) -> result pieces --------------------------

#: The largest count or offset a file tool takes (a file offset is a signed 64-bit number).
MAX_INT_ARG = 2 ** 62


def _opt_int(args, key, default, minimum=0):
    value = args.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_INT_ARG:
        raise FileToolError("%s must be an integer from %d to %d, got %r"
                            % (key, minimum, MAX_INT_ARG, value))
    return value


def _encoding(args):
    enc = args.get("encoding", "text") or "text"
    if enc not in ("text", "base64"):
        raise FileToolError("encoding must be 'text' or 'base64', got %r" % (enc,))
    return enc


def _require_path(args):
    path = args.get("path")
    if not isinstance(path, str) or not path:
        raise FileToolError("missing required argument 'path' (a non-empty string)")
    return path


def read_file(ws, args, output_limit=50000):
    """``{path, offset, limit, encoding}``: text reads lines (``offset`` 0-based first line,
    ``limit`` max lines); base64 reads bytes (``offset``/``limit`` in bytes)."""
    path = _require_path(args)
    enc = _encoding(args)
    offset = _opt_int(args, "offset", 0)
    limit = _opt_int(args, "limit", None, 1)
    if enc == "base64":
        # Cap by bytes so the base64 stays decodable; continue with a larger offset.
        cap = max(3, (output_limit // 4) * 3)
        want = cap if limit is None else min(limit, cap)
        data, st, shown = ws.read_bytes(path, offset, want)
        more = offset + len(data) < st.st_size and (limit is None or limit > len(data))
        return base64.b64encode(data).decode(), {"path": shown, "size": st.st_size, "offset": offset,
                                                 "bytes": len(data), "encoding": "base64",
                                                 "truncated": more}
    fh, st, shown = ws.open_read(path)
    with fh:
        head, tail, dropped, lines, total = _read_lines(fh, offset, limit, 2 * output_limit)
    text = head.decode("utf-8", "replace")
    truncated = False
    if dropped:  # the middle was never held: head and tail around the marker, as _cap does
        keep = output_limit // 2
        tail_text = tail.decode("utf-8", "replace")
        omitted = len(text) - keep + dropped + len(tail_text) - keep
        from .shell import marker
        text = text[:keep] + marker(omitted) + tail_text[len(tail_text) - keep:]
        truncated = True
    else:
        text += tail.decode("utf-8", "replace")
    return text, {"path": shown, "size": st.st_size, "total_lines": total, "first_line": offset,
                  "lines": lines, "encoding": "text", "truncated": truncated}


def _read_lines(fh, offset, limit, keep):
    """Lines ``offset`` .. ``offset + limit`` of a file (all from ``offset`` when ``limit`` is
    None) as ``(head, tail, dropped, lines, total)``: the first ``keep`` bytes of them, the
    last ``keep`` bytes after those, how many bytes between were dropped, how many lines
    were chosen, and the file's line count (of its first :data:`MAX_READ_BYTES`).

    Memory is bounded by ``3 * keep`` plus one chunk whatever the file holds; time is
    linear in the file (lines are counted in C with ``bytes.count``).
    """
    end = None if limit is None else offset + limit
    head = bytearray()
    tail = bytearray()
    dropped = chosen_lines = 0
    line = 0  # index of the line the next chunk starts in
    read = 0
    last = b""
    while read < MAX_READ_BYTES:
        chunk = fh.read(min(READ_CHUNK, MAX_READ_BYTES - read))
        if not chunk:
            break
        read += len(chunk)
        last = chunk
        breaks = chunk.count(b"\n")
        if line + breaks >= offset and (end is None or line < end):
            # The chosen lines of this chunk as one slice (no per-line work: a file of
            # millions of short lines must not hold the GIL line by line).
            start = 0 if offset <= line else _after_nth(chunk, offset - line)
            stop = len(chunk) if end is None or end > line + breaks else _after_nth(chunk, end - line)
            piece = chunk[start:stop]
            chosen_lines += piece.count(b"\n")
            room = keep - len(head)
            if room > 0:
                head += piece[:room]
                piece = piece[room:]
            tail += piece
            if len(tail) > 2 * keep:
                cut = len(tail) - keep
                dropped += cut
                del tail[:cut]
        line += breaks
    if last and not last.endswith(b"\n"):
        if offset <= line and (end is None or line < end):
            chosen_lines += 1  # the last line has no newline
        line += 1
    if len(tail) > keep:
        cut = len(tail) - keep
        dropped += cut
        del tail[:cut]
    return bytes(head), bytes(tail), dropped, chosen_lines, line


def _after_nth(data, n):
    """The index just after the ``n``-th newline of ``data`` (n >= 1; it has that many)."""
    pos = -1
    for _ in range(n):
        pos = data.find(b"\n", pos + 1)
    return pos + 1


def write_file(ws, args, limit=50000):
    path = _require_path(args)
    enc = _encoding(args)
    content = args.get("content")
    if not isinstance(content, str):
        raise FileToolError("missing required argument 'content' (a string)")
    append = args.get("append", False)
    if not isinstance(append, bool):
        raise FileToolError("append must be true or false, got %r" % (append,))
    if enc == "base64":
        try:
            data = base64.b64decode(content.encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError) as exc:
            raise FileToolError("content is not valid base64: %s" % exc) from None
    else:
        data = content.encode("utf-8", "surrogatepass")
    shown = ws.write_bytes(path, data, append=append)
    verb = "appended" if append else "wrote"
    return "%s %d bytes to %s" % (verb, len(data), shown), {"path": shown, "bytes": len(data)}


def utf8_entries(entries):
    """Entries whose names are valid UTF-8 (what every string the API returns must be).

    A name that is not (a file named with bytes such as ``\\xff``) is shown with a
    backslash escape for each such byte (``report\\xff.txt``) and the exact bytes are
    given base64-encoded in ``raw_path``.
    """
    out = []
    for e in entries:
        try:
            e["path"].encode("utf-8")
        except UnicodeEncodeError:
            raw = e["path"].encode("utf-8", "surrogateescape")
            e = dict(e, path=raw.decode("utf-8", "backslashreplace"),
                     raw_path=base64.b64encode(raw).decode("ascii"))
        out.append(e)
    return out


def _listing(ws, args, default_max):
    """The listing both list tools share: ``(entries, truncated, shown, recursive, max_entries)``
    with names made valid UTF-8 by ``utf8_entries``."""
    recursive = bool(args.get("recursive", False))
    max_entries = _opt_int(args, "max_entries", default_max, 1)
    entries, truncated, shown = ws.list_dir(args.get("path") or ".", recursive, max_entries)
    return utf8_entries(entries), truncated, shown, recursive, max_entries


def list_files(ws, args, limit=50000):
    entries, truncated, shown, _, max_entries = _listing(ws, args, 1000)
    lines = [e["path"] + ("/" if e["type"] == "dir" else "") for e in entries]
    if truncated:
        lines.append("... (more than %d entries)" % max_entries)
    return "\n".join(lines), {"path": shown, "entries": entries, "truncated": truncated}


def read_artifact(ws, args, limit=50000):
    path = _require_path(args)
    enc = _encoding(args)
    # Bounded like every per-call buffer, by the call's cap: max_bytes when given (at most
    # MAX_READ_BYTES), else the output cap in bytes; "truncated" says when the file has more.
    # ``offset`` (bytes) continues a read that came back truncated.
    max_bytes = _opt_int(args, "max_bytes", None, 1)
    offset = _opt_int(args, "offset", 0)
    cap = min(max_bytes or limit, MAX_READ_BYTES)
    data, st, shown = ws.read_bytes(path, offset, cap)
    content = base64.b64encode(data).decode() if enc == "base64" else data.decode("utf-8", "replace")
    info = {"path": shown, "content": content, "encoding": enc, "size": st.st_size,
            "offset": offset, "truncated": offset + len(data) < st.st_size}
    if args.get("include_sha256"):
        import hashlib

        info["sha256"] = hashlib.sha256(data).hexdigest()
    return content, info


def list_artifacts(ws, args, limit=50000):
    entries, truncated, shown, recursive, _ = _listing(ws, args, 10000)
    names = [e["path"] for e in entries if not recursive or e["type"] != "dir"]
    return "\n".join(names), {"path": shown, "entries": names, "details": entries,
                              "truncated": truncated}


def archive_artifacts(ws, args, limit=50000):
    path = args.get("path") or "."
    fmt = args.get("archive_format", "tar.gz") or "tar.gz"
    max_bytes = _opt_int(args, "max_bytes", None, 1)
    max_entries = _opt_int(args, "max_entries", None, 1)
    data, count, shown = ws.archive(path, fmt, max_bytes, max_entries)
    encoded = base64.b64encode(data).decode()
    return ("archived %d entries of %s (%d bytes, %s)" % (count, shown, len(data), fmt),
            {"path": shown, "archive_base64": encoded, "format": fmt, "entries": count,
             "bytes": len(data)})


TOOLS = {
    "read_file": read_file,
    "write_file": write_file,
    "list_files": list_files,
    "read_artifact": read_artifact,
    "list_artifacts": list_artifacts,
    "archive_artifacts": archive_artifacts,
}
