"""Write archive members beneath a directory descriptor: a name from an archive is never
resolved through the host's file system.

Stdlib-only, Python 3.8. Used by the image unpacker (``hermes_modal_tool/images/unpack.py``,
on the host, as root) and the snapshot import (:mod:`.transfer`, in the agent).

A :class:`Tree` holds a descriptor of its root. A member's parent directory is opened
from it with ``openat2``:

- ``in_root=True`` (an image): ``RESOLVE_IN_ROOT``: the image's symlinks are followed as if
  the root were ``/`` (``/etc -> /host`` leads to ``ROOT/host``; ``..`` stops at the root),
  as containerd and umoci do;
- ``in_root=False`` (a snapshot): ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``: no symlink at all;

both with ``RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV``. Where ``openat2`` is missing
(Linux < 5.6: ``ENOSYS``; a seccomp filter: ``EPERM``) the same resolution is a walk, one
component at a time, each opened with ``O_NOFOLLOW | O_DIRECTORY`` relative to the one
before; a symlink is read with ``readlinkat`` and resolved by the walk itself, ``..`` goes
back to the descriptor it came from and never above the root.

The last component is never followed: what had the name is removed first (``unlinkat``,
a directory with everything in it by descriptor, see :func:`.trees.remove_at`), then the
member is made with ``O_CREAT | O_EXCL | O_NOFOLLOW``, ``mkdirat``, ``symlinkat``,
``linkat`` (no ``AT_SYMLINK_FOLLOW``) or ``mknodat``; owners, modes, extended attributes
and times go through the new file's own descriptor (``fchown``, ``fchmod``,
``fsetxattr``, ``futimens``), or ``fchownat``/``utimensat`` with ``AT_SYMLINK_NOFOLLOW``.
A duplicate name replaces, it never writes through.
"""

import errno
import os
import stat

from . import trees
from .mounts import RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_NO_XDEV, openat2

RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_MAX_HOPS = 40
# openat2 errors after which the walk decides: no openat2 (ENOSYS), a seccomp filter
# (EPERM), a rename racing RESOLVE_IN_ROOT (EAGAIN), flags this kernel does not know
# (EINVAL). ELOOP and EXDEV (a symlink or ".." where none may be) are final.
_FALLBACK = (errno.ENOSYS, errno.EPERM, errno.EAGAIN, errno.EINVAL)
_openat2_missing = []  # [True] once openat2 failed with ENOSYS: walk from then on


class Tree:
    """A directory tree written only beneath its root (see the module doc).

    Args:
        root: the root directory's path (not itself a symlink), opened once.
        in_root: follow symlinks of parent paths inside the root (an image), else
            refuse any symlink in a parent path (a snapshot).

    Raises:
        OSError: ``root`` is not a directory, or is a symlink.
    """

    def __init__(self, root, in_root=True):
        self.fd = os.open(root, _DIR | os.O_NOFOLLOW)
        self.in_root = in_root
        self._cached = None  # (parts, fd): the last parent opened
        self._stale = False  # the cached parent may no longer be what its parts lead to

    def close(self):
        self._drop()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def forget(self):
        """The next :meth:`parent` resolves again (a directory or symlink was removed or
        made); the descriptor last returned stays open until then."""
        self._stale = True

    def _drop(self):
        if self._cached is not None:
            os.close(self._cached[1])
            self._cached = None
        self._stale = False

    # -- resolving -------------------------------------------------------------------
    def parent(self, parts, create=False):
        """A descriptor of the directory ``parts`` (a list of names, relative to the root),
        resolved as the module doc says, missing directories made (mode 0755) when
        ``create``. The descriptor belongs to the tree (valid until the next call): do
        not close it.

        Raises:
            OSError: a component is not a directory (``ENOTDIR``), a symlink where none
                may be (``ELOOP``), too many symlinks, or missing (``ENOENT``).
        """
        key = tuple(parts)
        if self._cached is not None and self._cached[0] == key and not self._stale:
            return self._cached[1]
        self._drop()
        fd = self._open_dir(list(parts), create)
        self._cached = (key, fd)
        return fd

    def _open_dir(self, parts, create):
        if not parts:
            return os.dup(self.fd)
        if not _openat2_missing:
            resolve = RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV | (
                RESOLVE_IN_ROOT if self.in_root else RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)
            try:
                return openat2(self.fd, "/".join(parts), _DIR, resolve)
            except OSError as exc:
                if exc.errno == errno.ENOSYS:
                    _openat2_missing.append(True)
                elif exc.errno == errno.ENOENT and create:
                    pass  # made by the walk
                elif exc.errno not in _FALLBACK:
                    raise
        return self._walk(parts, create)

    def _walk(self, parts, create):
        """:meth:`_open_dir` without ``openat2``: one component at a time."""
        stack = [self.fd]  # stack[0] is the root (never closed here)
        todo = list(parts)
        hops = 0
        try:
            while todo:
                part = todo.pop(0)
                if part in ("", "."):
                    continue
                if part == "..":
                    if not self.in_root:
                        raise OSError(errno.EXDEV, "'..' in a path", "/".join(parts))
                    if len(stack) > 1:
                        os.close(stack.pop())
                    continue
                try:
                    fd = os.open(part, _DIR | os.O_NOFOLLOW, dir_fd=stack[-1])
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(part, 0o755, dir_fd=stack[-1])
                    fd = os.open(part, _DIR | os.O_NOFOLLOW, dir_fd=stack[-1])
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    st = os.stat(part, dir_fd=stack[-1], follow_symlinks=False)
                    if not stat.S_ISLNK(st.st_mode):
                        raise
                    if not self.in_root:
                        raise OSError(errno.ELOOP, "a symlink in the path",
                                      "/".join(parts)) from None
                    hops += 1
                    if hops > _MAX_HOPS:
                        raise OSError(errno.ELOOP, "too many symlinks", "/".join(parts)) from None
                    target = os.readlink(part, dir_fd=stack[-1])
                    if target.startswith("/"):
                        while len(stack) > 1:
                            os.close(stack.pop())
                    todo = target.split("/") + todo
                    continue
                stack.append(fd)
            return stack.pop() if len(stack) > 1 else os.dup(self.fd)
        finally:
            while len(stack) > 1:
                os.close(stack.pop())

    # -- changing --------------------------------------------------------------------
    def lstat(self, dir_fd, name):
        """``fstatat(AT_SYMLINK_NOFOLLOW)`` of ``name`` in ``dir_fd``, or None.

        Raises:
            ValueError: ``name`` is not one name of the directory (empty, ``.``, ``..``
                or with a ``/``): every change below goes through here first.
        """
        if name in ("", ".", "..") or "/" in name:
            raise ValueError("%r is not a name of a directory entry" % (name,))
        try:
            return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def remove(self, dir_fd, name):
        """Remove ``name`` from ``dir_fd`` whatever it is (a directory with everything in
        it), never following it. Returns whether something was there.

        Raises:
            OSError: it could not be removed.
        """
        st = self.lstat(dir_fd, name)
        if st is None:
            return False
        if stat.S_ISDIR(st.st_mode):
            self.forget()
            trees.remove_at(dir_fd, name)
            if self.lstat(dir_fd, name) is not None:
                raise OSError(errno.ENOTEMPTY, "could not remove the directory", name)
        else:
            if stat.S_ISLNK(st.st_mode):
                self.forget()
            os.unlink(name, dir_fd=dir_fd)
        return True

    def make_file(self, dir_fd, name, chunks):
        """Replace ``name`` with a regular file holding ``chunks`` (an iterable of bytes);
        returns its descriptor (open for writing: set metadata with :func:`set_meta`, then
        close it)."""
        self.remove(dir_fd, name)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=dir_fd)
        try:
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            raise
        return fd

    def make_dir(self, dir_fd, name):
        """``name`` as a directory: kept when it is one (not a symlink), else replaced.
        Returns True when it was there already."""
        st = self.lstat(dir_fd, name)
        if st is not None and stat.S_ISDIR(st.st_mode):
            return True
        self.remove(dir_fd, name)
        os.mkdir(name, 0o700, dir_fd=dir_fd)
        return False

    def make_symlink(self, dir_fd, name, target):
        self.remove(dir_fd, name)
        self.forget()
        os.symlink(target, name, dir_fd=dir_fd)

    def make_link(self, dir_fd, name, src_fd, src_name):
        """Replace ``name`` with a hard link to ``src_name`` of ``src_fd`` (the link itself
        when it is a symlink: never followed)."""
        if src_fd == dir_fd and src_name == name:
            return
        self.lstat(src_fd, src_name)  # a name, not a path
        self.remove(dir_fd, name)
        os.link(src_name, name, src_dir_fd=src_fd, dst_dir_fd=dir_fd, follow_symlinks=False)

    def make_node(self, dir_fd, name, kind, device=0):
        """Replace ``name`` with a FIFO (``kind`` ``stat.S_IFIFO``) or a device node."""
        self.remove(dir_fd, name)
        os.mknod(name, kind | 0o600, device, dir_fd=dir_fd)


def open_node(dir_fd, name, kind):
    """A descriptor for the metadata of ``name`` (just made, of type ``kind``): the file
    itself for a directory, else an ``O_PATH`` descriptor; never following a symlink."""
    if kind == stat.S_IFDIR:
        return os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=dir_fd)
    return os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def set_meta(fd, uid=None, gid=None, mode=None, mtime=None, xattrs=(), path_fd=False,
             xattr_errors=True):
    """Set what is given on the file open at ``fd`` (owner first: ``chown`` clears set-id
    bits). ``path_fd``: ``fd`` is an ``O_PATH`` descriptor (a FIFO, device node or
    symlink), reached through its ``/proc/self/fd`` link, which leads to the descriptor's
    own file (a symlink itself, not what it points to), never through a path lookup; no
    mode is set on a symlink. ``xattrs``: ``(name, bytes)`` pairs; with
    ``xattr_errors=False`` one the file system refuses is skipped.
    """
    target = "/proc/self/fd/%d" % fd if path_fd else fd
    is_link = path_fd and stat.S_ISLNK(os.fstat(fd).st_mode)
    if uid is not None:
        os.chown(target, uid, gid)
    for name, value in xattrs:
        try:
            os.setxattr(target, name, value)
        except OSError:
            if xattr_errors:
                raise
    if mode is not None and not is_link:
        os.chmod(target, mode)
    if mtime is not None:
        os.utime(target, (mtime, mtime))
