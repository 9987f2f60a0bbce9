"""A directory as a tar stream, both ways, relative to directory descriptors only.

Stdlib-only, Python 3.8. Used by the agent (a slot's directory out: :func:`pack`; into a
slot: :func:`unpack`; ``agent/files/streams.py``) and by the host (``filetransfer.py``:
a local directory up, a slot's directory down), so both ends read and write one format:
a POSIX (pax) tar of regular files, directories, symbolic links and hard links to earlier
members, owners 0, modes without set-id bits.

:func:`pack` walks from a descriptor with ``O_NOFOLLOW`` at every step; symbolic links are
stored as links (never followed), those that lead out of the directory (absolute, or
``..`` past its top) and anything that is not a file, directory or link are left out and
counted; a file's second and later names in the tree are stored as hard links to its
first (a name in the stream), so hard links arrive as links, not copies. :func:`unpack` treats the stream as hostile: a member named absolutely or with
``..``, below a symbolic link, a link leading out of the directory, a hard link to
anything but an earlier file of the stream (an absolute target, ``..``, or a name the
stream did not make: not even a file the directory already has), a device node, FIFO or any other type, or an
over-long header refuses the whole stream (:class:`TarRefused`) before that member is
written; members are made beneath the root descriptor (``fs/beneath.py``: ``openat2``
with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``, or an ``O_NOFOLLOW`` walk), a name that
exists is replaced, never written through. Memory is bounded: the stream is read in
pieces, members are not kept, and at most :data:`MAX_MEMBERS` names are remembered.
"""

import errno
import os
import stat

from ..fs import beneath

#: Largest pax or GNU long-name header accepted (bytes): a header is read whole.
MAX_HEADER_BYTES = 1024 * 1024
#: Most members one stream may have (a name of each earlier file is kept for hard links).
MAX_MEMBERS = 1000000
PIECE = 1024 * 1024
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class TarRefused(Exception):
    """A member of a stream that :func:`unpack` does not write; the message names it."""


def _tarfile():
    import tarfile  # here: it costs ~5 ms of every agent's start

    return tarfile


def escapes(parts, target):
    """Whether symbolic link ``parts`` (its name's components) with ``target`` leads out
    of the tree's top (absolute, or ``..`` above it)."""
    if not target or target.startswith("/") or "\x00" in target:
        return True
    depth = len(parts) - 1  # the link's directory, below the top
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part not in ("", "."):
            depth += 1
    return False


# -- out: a directory descriptor -> a tar stream -----------------------------------------
def pack(root_fd, out, owner=None, on_file=None, skip=None):
    """Write the tree below ``root_fd`` (a directory descriptor, not closed) as a tar
    stream to ``out`` (an object with ``write(bytes)``). ``owner``: only files owned by
    this uid are read (others left out and counted: a hard link to a file the caller may
    not read is no way in). A file with several names in the tree is packed once, under
    the first name met (sorted, depth first); its other names go as hard links to that one
    (not counted in ``files``), so they arrive as one file with several names, never as
    copies. ``on_file(nbytes)`` after each file. ``skip``: relative names of regular files
    left out and not counted (a resumed transfer's files the other end has already).
    Returns ``(files, bytes, skipped)``.

    Raises:
        OSError: a file could not be read; TarRefused: a file changed size meanwhile.
    """
    tarfile = _tarfile()
    files = total = skipped = 0
    tar = tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT, bufsize=PIECE,
                       encoding="utf-8", errors="surrogateescape")
    tar.copybufsize = PIECE
    # A file with more than one name: the first name packed, by (device, inode); a later
    # name of it goes as a hard link to that one (at most one entry per such file).
    first_names = {}
    walk = entries_below(root_fd, owner)
    try:
        for path, dfd, name, st, left_out in walk:
            if left_out:
                skipped += 1
                continue
            info = tarfile.TarInfo(path)
            info.mtime = int(st.st_mtime)
            info.mode = stat.S_IMODE(st.st_mode) & 0o1777
            if stat.S_ISDIR(st.st_mode):  # entered next by the walk
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif stat.S_ISLNK(st.st_mode):
                target = os.readlink(name, dir_fd=dfd)
                if escapes(path.split("/"), target):
                    skipped += 1
                    continue
                info.type = tarfile.SYMTYPE
                info.linkname = target
                info.mode = 0o777
                tar.addfile(info)
            elif stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and (st.st_dev, st.st_ino) in first_names:
                info.type = tarfile.LNKTYPE  # another name of a file packed before
                info.linkname = first_names[(st.st_dev, st.st_ino)]
                tar.addfile(info)
            elif stat.S_ISREG(st.st_mode) and skip and path in skip:
                continue
            elif stat.S_ISREG(st.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
                with os.fdopen(fd, "rb") as fh:
                    now = os.fstat(fd)
                    if not stat.S_ISREG(now.st_mode) or now.st_ino != st.st_ino:
                        skipped += 1  # swapped meanwhile
                        continue
                    info.size = now.st_size
                    try:
                        tar.addfile(info, fh)
                    except OSError as exc:
                        if "unexpected end of data" in str(exc):
                            raise TarRefused("%s got shorter while it was read" % path) from None
                        raise
                files += 1
                total += info.size
                if now.st_nlink > 1 and len(first_names) < MAX_MEMBERS:
                    first_names[(now.st_dev, now.st_ino)] = path
                if on_file is not None:
                    on_file(info.size)
            else:
                skipped += 1  # a device node, FIFO or socket
        tar.close()
    finally:
        walk.close()
    return files, total, skipped


def entries_below(root_fd, owner=None):
    """Yield ``(relative name, dir_fd, name, stat, left_out)`` of each entry below directory
    descriptor ``root_fd`` (not closed): sorted, depth first, one open directory per level
    (a wide directory holds no descriptors), ``O_NOFOLLOW`` at every step, a directory
    entered right after it is yielded; ``dir_fd`` is valid until the next item. An entry
    removed meanwhile is passed over. ``left_out`` is None for an entry to use, else why it
    is not entered: ``"not owned"`` (``owner`` given and the entry, not a symbolic link,
    is another uid's) or ``"not opened"`` (a directory that could not be opened).
    Used by :func:`pack` and ``treesums.files_below`` (the same tree, the same order)."""
    stack = [("", os.dup(root_fd), None)]
    try:
        while stack:
            rel, dfd, names = stack[-1]
            if names is None:
                names = iter(sorted(os.listdir(dfd)))
                stack[-1] = (rel, dfd, names)
            name = next(names, None)
            if name is None:
                stack.pop()
                os.close(dfd)
                continue
            path = rel + name
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed meanwhile
            if owner is not None and st.st_uid != owner and not stat.S_ISLNK(st.st_mode):
                yield path, dfd, name, st, "not owned"
                continue
            if stat.S_ISDIR(st.st_mode):
                try:
                    sub = os.open(name, _DIR, dir_fd=dfd)
                except OSError:
                    yield path, dfd, name, st, "not opened"
                    continue
                stack.append((path + "/", sub, None))  # closed with the walk if it stops here
            yield path, dfd, name, st, None
    finally:
        for _, dfd, _ in stack:
            os.close(dfd)


# -- in: a tar stream -> beneath a directory descriptor --------------------------------
class _FdTree(beneath.Tree):
    """A :class:`beneath.Tree` on a descriptor the caller opened (relative to a slot's
    view, or a local directory), with symbolic links refused in every parent path."""

    def __init__(self, fd):  # not super().__init__: it opens a path; this tree has a descriptor
        self.fd = os.dup(fd)
        self.in_root = False
        self._cached = None
        self._stale = False


def _checked_tarinfo(tarfile):
    class Info(tarfile.TarInfo):
        def _proc_member(self, tar):
            if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
                             tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE) and self.size > MAX_HEADER_BYTES:
                raise TarRefused("a header of %d bytes (more than %d)" % (self.size, MAX_HEADER_BYTES))
            return super()._proc_member(tar)
    return Info


def _parts(name):
    if name.startswith("/") or "\x00" in name:
        raise TarRefused("member %r has an absolute name" % name)
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise TarRefused("member %r climbs out with '..'" % name)
    return parts


def _link_parts(member):
    """The components of hard link ``member``'s target, a name in the stream."""
    name = member.linkname
    if not name or name.startswith("/") or "\x00" in name:
        raise TarRefused("hard link %r to %r: its target is absolute (a name in the stream only)"
                         % (member.name, name))
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise TarRefused("hard link %r to %r climbs out with '..'" % (member.name, name))
    return parts


def unpack(src, root_fd, owner=None, on_file=None):
    """Make the members of tar stream ``src`` (an object with ``read(n)``) beneath
    directory descriptor ``root_fd`` (not closed), as the module doc says. ``owner``:
    ``(uid, gid)`` given to everything made (None: whoever makes it owns it).
    ``on_file(nbytes)`` after each file. Returns ``(files, bytes)``.

    Raises:
        TarRefused: a hostile or unsupported member (those before it are made);
        OSError: the file system refused a write (no space, permission).
    """
    tarfile = _tarfile()
    files = total = count = 0
    seen = set()  # names of files made (hard-link targets)
    links = set()  # names of symbolic links made
    dirs = []  # (parts, (dev, ino), mode, mtime): modes set last, deepest first
    tree = _FdTree(root_fd)
    try:
        try:
            tar = tarfile.open(fileobj=src, mode="r|", tarinfo=_checked_tarinfo(tarfile),
                               encoding="utf-8", errors="surrogateescape")
        except tarfile.ReadError as exc:
            if "empty file" in str(exc):
                return 0, 0
            raise TarRefused("not a tar stream: %s" % exc) from None
        with tar:
            for member in _members(tar, tarfile):
                count += 1
                if count > MAX_MEMBERS:
                    raise TarRefused("more than %d members" % MAX_MEMBERS)
                parts = _parts(member.name)
                if not parts:
                    continue  # the top itself: it exists
                for j in range(1, len(parts)):
                    if "/".join(parts[:j]) in links:
                        raise TarRefused("member %r is below the symbolic link %r"
                                         % (member.name, "/".join(parts[:j])))
                key = "/".join(parts)
                mode = stat.S_IMODE(member.mode) & 0o1777
                try:
                    parent = tree.parent(parts[:-1], create=True)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR):
                        raise TarRefused("member %r: its directory is not one (or is a symbolic "
                                         "link)" % member.name) from None
                    raise
                name = parts[-1]
                if member.isdir():
                    tree.make_dir(parent, name)
                    st = tree.lstat(parent, name)
                    _own(parent, name, owner)
                    dirs.append((parts, (st.st_dev, st.st_ino), mode, member.mtime))
                elif member.isreg():
                    try:
                        fd = tree.make_file(parent, name, _pieces(tar.extractfile(member)))
                    except tarfile.ReadError as exc:  # cut short: what came is kept (a resume continues it)
                        raise TarRefused("member %r: %s" % (member.name, exc)) from None
                    try:
                        if owner is not None:
                            os.fchown(fd, owner[0], owner[1])
                        os.fchmod(fd, mode)
                        os.utime(fd, (member.mtime, member.mtime))
                    finally:
                        os.close(fd)
                    links.discard(key)
                    seen.add(key)
                    files += 1
                    total += member.size
                    if on_file is not None:
                        on_file(member.size)
                elif member.issym():
                    if escapes(parts, member.linkname):
                        raise TarRefused("symbolic link %r -> %r leads out of the directory"
                                         % (member.name, member.linkname))
                    tree.make_symlink(parent, name, member.linkname)
                    _own(parent, name, owner)
                    links.add(key)
                    seen.discard(key)
                elif member.islnk():
                    target = "/".join(_link_parts(member))
                    if target not in seen:
                        raise TarRefused("hard link %r to %r, not an earlier file of the stream"
                                         % (member.name, member.linkname))
                    src_parts = target.split("/")
                    src_fd = os.dup(tree.parent(src_parts[:-1]))
                    try:
                        tree.make_link(tree.parent(parts[:-1], create=True), name, src_fd, src_parts[-1])
                    finally:
                        os.close(src_fd)
                    links.discard(key)
                    seen.add(key)
                elif member.isdev():
                    raise TarRefused("device node %r is refused" % member.name)
                else:
                    raise TarRefused("member %r of type %r is refused (files, directories and "
                                     "links only)" % (member.name, member.type))
        for parts, ident, mode, mtime in reversed(dirs):
            try:
                fd = beneath.open_node(tree.parent(parts[:-1]), parts[-1], stat.S_IFDIR)
            except OSError:
                continue  # replaced by a later member
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == ident:
                    os.fchmod(fd, mode)
                    os.utime(fd, (mtime, mtime))
            finally:
                os.close(fd)
    finally:
        tree.close()
    return files, total


def _members(tar, tarfile):
    """The members of a stream read with ``r|``, none kept (``TarFile.members`` would
    hold every one)."""
    while True:
        try:
            member = tar.next()
        except tarfile.TarError as exc:
            raise TarRefused("bad tar stream: %s" % exc) from None
        if member is None:
            return
        tar.members = []
        yield member


def _pieces(reader):
    while True:
        piece = reader.read(PIECE)
        if not piece:
            return
        yield piece


def _own(dir_fd, name, owner):
    if owner is not None:
        os.chown(name, owner[0], owner[1], dir_fd=dir_fd, follow_symlinks=False)
