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
    """``{path, offset, limit, byte_offset, encoding}``: one page of a file.

    text: whole lines from line ``offset`` (0-based; ``byte_offset`` bytes into it, to go on
    inside a line longer than a page), at most ``limit`` lines and ``output_limit`` bytes.
    base64: bytes from byte ``offset``, at most ``limit`` and the output cap.

    A page that does not reach the end of the file says ``truncated: true`` and where to go
    on: ``next_offset`` (and, for a text page that ended inside a line, ``next_byte_offset``);
    reading each next page that way returns the whole file exactly. Text pages see the
    first :data:`MAX_READ_BYTES` of a file (``total_lines`` counts those); past that
    ``next_offset`` is None and base64 reads go on from byte ``end_byte``.
    """
    path = _require_path(args)
    enc = _encoding(args)
    offset = _opt_int(args, "offset", 0)
    limit = _opt_int(args, "limit", None, 1)
    skip = _opt_int(args, "byte_offset", 0)
    if enc == "base64":
        if skip:
            raise FileToolError("byte_offset is for text reads; a base64 read's offset is in bytes")
        # Cap by bytes so the base64 stays decodable; continue with a larger offset.
        cap = max(3, (output_limit // 4) * 3)
        want = cap if limit is None else min(limit, cap)
        data, st, shown = ws.read_bytes(path, offset, want)
        end = offset + len(data)
        more = end < st.st_size and (limit is None or limit > len(data))
        return base64.b64encode(data).decode(), {"path": shown, "size": st.st_size, "offset": offset,
                                                 "bytes": len(data), "encoding": "base64",
                                                 "end_byte": end, "truncated": more,
                                                 "next_offset": end if more else None}
    fh, st, shown = ws.open_read(path)
    with fh:
        page = _read_page(fh, offset, skip, limit, max(4, output_limit))
    data, lines, total, end, next_offset, next_skip = page
    info = {"path": shown, "size": st.st_size, "total_lines": total, "first_line": offset,
            "lines": lines, "encoding": "text", "end_byte": end,
            "truncated": next_offset is not None or end < st.st_size,
            "next_offset": next_offset}
    if skip:
        info["byte_offset"] = skip
    if next_skip:
        info["next_byte_offset"] = next_skip
    return data.decode("utf-8", "replace"), info


def _read_page(fh, offset, skip, limit, budget):
    """The page of a text read as ``(data, lines, total, end, next_offset, next_skip)``:
    the page's bytes, how many lines they touch, the file's line count (of its first
    :data:`MAX_READ_BYTES`), the byte position after the page, and where the next page
    starts (None when the page reaches the end of what text reads see).

    One pass counts the lines and finds where line ``offset`` starts (bytes are counted in
    C with ``bytes.count``); the page itself is one read of at most ``budget`` bytes, so
    memory stays bounded by a chunk plus a page whatever the file holds.
    """
    line = 0  # lines that ended before the current chunk
    pos = 0  # byte position of the current chunk
    start = stop = None  # where line `offset` starts and where its newline is
    last = b""
    while pos < MAX_READ_BYTES:
        chunk = fh.read(min(READ_CHUNK, MAX_READ_BYTES - pos))
        if not chunk:
            break
        breaks = chunk.count(b"\n")
        if start is None and line + breaks >= offset:
            start = pos + (_after_nth(chunk, offset - line) if offset > line else 0)
        if start is not None and stop is None:
            at = chunk.find(b"\n", max(0, start - pos))
            if at >= 0:
                stop = pos + at
        line += breaks
        pos += len(chunk)
        last = chunk
    horizon = pos  # what text reads see: the file, or its first MAX_READ_BYTES
    total = line + (1 if last and not last.endswith(b"\n") else 0)
    if start is None or start >= horizon:
        return b"", 0, total, horizon, None, 0
    line_end = horizon if stop is None else stop
    if start + skip > line_end:
        raise FileToolError("byte_offset %d is past the end of line %d (%d bytes long)"
                            % (skip, offset, line_end - start))
    begin = start + skip
    fh.seek(begin)
    data = fh.read(min(budget, horizon - begin))
    end_offset = None
    if limit is not None:
        cut = _after_nth_or_none(data, limit)
        if cut is not None:
            data = data[:cut]
            end_offset = offset + limit
    end = begin + len(data)
    if end_offset is None and end < horizon:  # the page is full: end it after a whole line
        cut = data.rfind(b"\n") + 1
        if cut:
            data = data[:cut]
            end_offset = offset + data.count(b"\n")
        else:  # the line is longer than a page: cut it (between UTF-8 characters)
            cut = _char_boundary(data)
            return data[:cut], 1, total, begin + cut, offset, skip + cut
        end = begin + len(data)
    lines = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    if end >= horizon:
        return data, lines, total, end, None, 0
    return data, lines, total, end, end_offset, 0


def _char_boundary(data):
    """The length of ``data`` less a UTF-8 character cut at its end (all of it when none is)."""
    i = len(data)
    while i > 0 and len(data) - i < 3 and 0x80 <= data[i - 1] < 0xC0:
        i -= 1  # continuation bytes
    if i > 0 and data[i - 1] >= 0xC0:
        lead = data[i - 1]
        need = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
        if len(data) - (i - 1) < need and i > 1:
            return i - 1
    return len(data)


def _after_nth(data, n):
    """The index just after the ``n``-th newline of ``data`` (n >= 1; it has that many)."""
    pos = -1
    for _ in range(n):
        pos = data.find(b"\n", pos + 1)
    return pos + 1


def _after_nth_or_none(data, n):
    """The index just after the ``n``-th newline of ``data``, or None when it has fewer."""
    pos = -1
    for _ in range(n):
        pos = data.find(b"\n", pos + 1)
        if pos < 0:
            return None
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
