"""A directory's regular files with their sizes, modes and SHA-256: what a resumed
directory transfer compares (``hermes_modal_tool/_transfer_resume.py``), on both ends.

Stdlib-only, Python 3.8. The walk starts at a directory descriptor and never follows a
link (``O_NOFOLLOW`` at every step, the order of :func:`tarstream.pack`: sorted, depth
first, one open directory per level); a file is hashed from a descriptor checked to be
the file listed. The agent runs it in a download stream's thread with the slot's
credentials (``kind: "manifest"``, ``agent/files/streamout.py``); the host on its own
directory in a worker thread.

A manifest is JSON lines, one per regular file: ``{"p": relative name, "s": size,
"m": mode (permission bits, as a tar stream carries them), "n": links, "t": mtime (s),
"h": SHA-256 of the file}`` and, where the asker gave a shorter size for that name,
``"ph"``: the SHA-256 of the file's first that many bytes (so a partial copy is checked
without a second read). Names are ``str`` as ``os.listdir`` gives them (undecodable
bytes as surrogates, which JSON escapes and gives back).
"""

import hashlib
import json
import os
import stat

from . import tarstream

PIECE = 1024 * 1024
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def files_below(root_fd, owner=None):
    """Yield ``(relative name, dir_fd, name, stat)`` of each regular file below directory
    descriptor ``root_fd`` (not closed), in :func:`tarstream.entries_below`'s walk (the
    order :func:`tarstream.pack` packs in); ``owner``: only files (and directories) of
    this uid. ``dir_fd`` is valid until the next item."""
    walk = tarstream.entries_below(root_fd, owner)
    try:
        for rel, dfd, name, st, left_out in walk:
            if left_out is None and stat.S_ISREG(st.st_mode):
                yield rel, dfd, name, st
    finally:
        walk.close()


def file_sums(dir_fd, name, st, prefix=None):
    """``(sha256 of the whole file, sha256 of its first prefix bytes or None)`` of file
    ``name`` of ``dir_fd``, read once; None when it is no longer the file ``st`` lists."""
    try:
        fd = os.open(name, _FILE, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return None
        digest = hashlib.sha256()
        head = None
        at = 0
        while True:
            if prefix is not None and head is None and at == prefix:
                head = digest.hexdigest()
            want = PIECE if prefix is None or at >= prefix else min(PIECE, prefix - at)
            piece = os.read(fd, want)
            if not piece:
                break
            digest.update(piece)
            at += len(piece)
        return digest.hexdigest(), head
    finally:
        os.close(fd)


def entry(rel, st, sums):
    """A manifest line's fields (see the module doc)."""
    line = {"p": rel, "s": st.st_size, "m": stat.S_IMODE(st.st_mode) & 0o1777, "n": st.st_nlink,
            "t": int(st.st_mtime), "h": sums[0]}
    if sums[1] is not None:
        line["ph"] = sums[1]
    return line


def manifest(root_fd, out, owner=None, prefixes=None):
    """Write the manifest of the tree below ``root_fd`` to ``out`` (``write(bytes)``),
    one line per file; ``prefixes``: {relative name: size} the asker holds (a ``ph`` is
    given where the file is longer). Returns the number of files."""
    count = 0
    for rel, dfd, name, st in files_below(root_fd, owner):
        want = prefixes.get(rel) if prefixes else None
        if want is not None and not 0 <= want < st.st_size:
            want = None
        sums = file_sums(dfd, name, st, want)
        if sums is None:
            continue
        out.write((json.dumps(entry(rel, st, sums)) + "\n").encode("ascii"))
        count += 1
    return count


def parse_lines(blob, limit):
    """The JSON values of ``blob``'s lines (bytes), at most ``limit`` of them.

    Raises:
        ValueError: a line is not JSON, or there are more than ``limit``.
    """
    values = []
    for line in bytes(blob).splitlines():
        if line.strip():
            values.append(json.loads(line.decode("ascii")))
            if len(values) > limit:
                raise ValueError("more than %d lines" % limit)
    return values
