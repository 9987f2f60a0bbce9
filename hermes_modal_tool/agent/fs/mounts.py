"""Mount syscalls and per-thread file credentials for slot roots (see :mod:`.rootfs`).

Stdlib-only, Python 3.8 (``ctypes`` for the syscalls Python does not wrap).
"""

import ctypes
import errno
import os
import signal
import threading

SYS_OPEN_TREE = 428  # the same number on every architecture (new syscalls are unified)
SYS_MOVE_MOUNT = 429
SYS_OPENAT2 = 437
SYS_MOUNT_SETATTR = 442
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_IDMAP = 0x100000
CLONE_NEWNS = 0x20000
CLONE_NEWUSER = 0x10000000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MS_RDONLY = 0x1
MNT_DETACH = 2
RESOLVE_NO_XDEV = 0x1
RESOLVE_NO_MAGICLINKS = 0x2
RESOLVE_NO_SYMLINKS = 0x4

_libc = None


def libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
        _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                ctypes.c_ulong, ctypes.c_char_p]
    return _libc


def _check(result, what):
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))
    return result


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dir_fd, name, flags, resolve):
    """``openat2(2)``; raises OSError (``ENOSYS`` on kernels before 5.6)."""
    how = _OpenHow(flags | os.O_CLOEXEC, 0, resolve)
    return _check(libc().syscall(SYS_OPENAT2, dir_fd, os.fsencode(name), ctypes.byref(how),
                                 ctypes.sizeof(how)), "openat2 %s" % name)


def open_subdir_same_mount(dir_fd, name):
    """Open directory ``name`` in ``dir_fd`` without following symlinks or crossing a mount
    point (``EXDEV``). Used by every tree removal: a mount inside a tree is never entered."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        return openat2(dir_fd, name, flags, RESOLVE_NO_XDEV | RESOLVE_NO_SYMLINKS)
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise
    fd = os.open(name, flags, dir_fd=dir_fd)  # old kernel: compare devices at least
    if os.fstat(fd).st_dev != os.fstat(dir_fd).st_dev:
        os.close(fd)
        raise OSError(errno.EXDEV, "a mount point", name)
    return fd


def enter_private_mount_namespace():
    """Move the agent into a mount namespace of its own whose mounts are all private."""
    lib = libc()
    _check(lib.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(lib.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")


def userns_fd(uid, gid, inside=0):
    """A user namespace mapping ``inside`` -> ``uid``/``gid`` (one id), as an fd; made by a
    child. An idmapped mount made with it shows files owned by ``inside`` on disk as
    owned by ``uid``.

    The child is a ``clone(CLONE_VM | CLONE_NEWUSER)`` of this process that shares its
    memory and only sleeps (see :func:`_userns_fd_shared`: about 0.2 ms of CPU); where
    that cannot be made, the spawner's fork (:func:`use_userns_maker`), else a fork of
    this process (5-6 ms of CPU for a 60 MB agent, throwaway measurement). Raises OSError.
    """
    if _SHARED_OK[0]:
        try:
            return _userns_fd_shared(uid, gid, inside)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
                raise
            _SHARED_OK[0] = False  # refused here (a seccomp filter, an old kernel): fork
    maker = _USERNS_MAKER[0]
    if maker is not None:
        try:
            return maker(uid, gid, inside)
        except OSError:
            _USERNS_MAKER[0] = None  # the spawner is gone or failed: fork here from now on
    with _USERNS_LOCK:
        return _userns_fd(uid, gid, inside)


#: Who makes user namespaces instead of a fork of this process (see :func:`use_userns_maker`).
_USERNS_MAKER = [None]
#: ``pause(2)`` on this machine: what the shared child runs (machines without it fork).
_SYS_PAUSE = {"x86_64": 34}.get(os.uname().machine) if ctypes.sizeof(ctypes.c_void_p) == 8 else None
_SHARED_OK = [_SYS_PAUSE is not None]
CLONE_VM = 0x100
WALL = 0x40000000  # __WALL: wait for a child whatever its exit signal
#: Stack of the shared child (it runs one libc call: ``syscall(SYS_pause)``).
_CHILD_STACK = 16384
#: A ``sigset_t`` (glibc's: 1,024 bits) with every signal in it.
_SIGSET_BYTES = 128
_ALL_SIGNALS = ctypes.create_string_buffer(b"\xff" * _SIGSET_BYTES, _SIGSET_BYTES)


def use_userns_maker(maker):
    """Make :func:`userns_fd`'s namespaces with ``maker(uid, gid, inside) -> fd`` (the
    agent's spawner: a fork of a small process is cheaper than one of the agent) where
    no shared child can be made; after an OSError from it (gone, or refused) this
    process makes them itself again."""
    _USERNS_MAKER[0] = maker


#: One namespace child at a time: a child made meanwhile by another thread would inherit
#: this one's pipe ends (no exec closes them) and each could wait for the other forever.
_USERNS_LOCK = threading.Lock()


def _userns_fd_shared(uid, gid, inside):
    """:func:`userns_fd` with a child that copies nothing: ``clone(CLONE_VM |
    CLONE_NEWUSER)`` running libc's ``syscall(SYS_pause)`` on a stack of its own. It runs
    no Python and touches no memory but that stack; every signal is blocked in it (the
    mask is set around the clone), so only the SIGKILL sent once the maps are written
    ends it. It has no exit signal: a ``waitpid(-1)`` elsewhere never reaps it, only
    the ``__WALL`` wait here. Raises OSError (``EINVAL``/``EPERM``/``ENOSYS``: it cannot
    be made here)."""
    lib = libc()
    stack = ctypes.create_string_buffer(_CHILD_STACK)
    top = (ctypes.addressof(stack) + _CHILD_STACK - 64) & ~15
    fn = ctypes.cast(lib.syscall, ctypes.c_void_p)
    # libc's pthread_sigmask: signal.pthread_sigmask makes an enum of each of 64 signals,
    # both ways (0.24 ms more CPU per namespace).
    old = ctypes.create_string_buffer(_SIGSET_BYTES)
    _check(lib.pthread_sigmask(signal.SIG_BLOCK, _ALL_SIGNALS, old), "pthread_sigmask")
    try:
        pid = lib.clone(fn, ctypes.c_void_p(top), ctypes.c_int(CLONE_VM | CLONE_NEWUSER),
                        ctypes.c_void_p(_SYS_PAUSE))
        err = ctypes.get_errno()
    finally:
        lib.pthread_sigmask(signal.SIG_SETMASK, old, None)
    if pid < 0:
        raise OSError(err, "clone(CLONE_VM | CLONE_NEWUSER): %s" % os.strerror(err))
    try:
        return _map_and_open(pid, uid, gid, inside)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, WALL)
        del stack  # only now: the child ran on it until the wait


def write_control(path, data):
    """Write ``data`` (bytes) to the kernel's control file ``path`` (a user namespace's
    id maps, a cgroup's limits or ``tasks``) in one ``write``, as such files take it: no
    Python file object. Raises OSError (``EIO`` on a short write)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.EIO, "short write to %s" % path)
    finally:
        os.close(fd)


def _map_and_open(pid, uid, gid, inside):
    """Map ``inside`` to ``uid``/``gid`` in child ``pid``'s new user namespace; its fd."""
    for name, text in (("uid_map", b"%d %d 1" % (inside, uid)), ("setgroups", b"deny"),
                       ("gid_map", b"%d %d 1" % (inside, gid))):
        write_control("/proc/%d/%s" % (pid, name), text)
    return os.open("/proc/%d/ns/user" % pid, os.O_RDONLY | os.O_CLOEXEC)


def _userns_fd(uid, gid, inside):
    lib = libc()
    go_r, go_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child only makes syscalls and exits
        try:
            os.close(go_w)
            os.close(ready_r)
            ok = lib.unshare(CLONE_NEWUSER) == 0
            os.write(ready_w, b"1" if ok else b"0")
            os.read(go_r, 1)
        finally:
            os._exit(0)
    os.close(go_r)
    os.close(ready_w)
    try:
        if os.read(ready_r, 1) != b"1":
            raise OSError(errno.EPERM, "cannot create a user namespace for the idmapped mount")
        return _map_and_open(pid, uid, gid, inside)
    finally:
        os.close(go_w)
        os.close(ready_r)
        os.waitpid(pid, 0)


def mount_idmapped(source, target, ns):
    """Attach a read-only clone of ``source`` at ``target``, ids mapped by user namespace
    ``ns`` (an fd from :func:`userns_fd`)."""
    lib = libc()
    tree = _check(lib.syscall(SYS_OPEN_TREE, AT_FDCWD, os.fsencode(source),
                              OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC), "open_tree %s" % source)
    try:
        attr = _MountAttr(MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV, 0, 0, ns)
        _check(lib.syscall(SYS_MOUNT_SETATTR, tree, b"", AT_EMPTY_PATH, ctypes.byref(attr),
                           ctypes.sizeof(attr)), "mount_setattr(IDMAP) %s" % source)
        move_mount_fd(tree, target)
    finally:
        os.close(tree)


def clone_tree(path):
    """A detached copy of the mount at ``path`` and every mount below it (``open_tree``
    with ``OPEN_TREE_CLONE | AT_RECURSIVE``), as a close-on-exec fd for :func:`move_mount_fd`."""
    return _check(libc().syscall(SYS_OPEN_TREE, AT_FDCWD, os.fsencode(path),
                                 OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE),
                  "open_tree %s" % path)


def move_mount_fd(tree, target):
    """Attach the detached mount ``tree`` (from :func:`clone_tree`) at ``target``."""
    _check(libc().syscall(SYS_MOVE_MOUNT, tree, b"", AT_FDCWD, os.fsencode(target),
                          MOVE_MOUNT_F_EMPTY_PATH), "move_mount %s" % target)


def mount_overlay(lower, upper, work, target, extra=None):
    # volatile: no sync of the upper file system, ever (unmount synced it: 200 ms for a
    # layer of 200 MB not yet written back); the layer is thrown away, never reused.
    opts = "lowerdir=%s,upperdir=%s,workdir=%s,volatile" % (lower, upper, work)
    if extra:
        opts += "," + extra
    _check(libc().mount(b"overlay", os.fsencode(target), b"overlay", 0, os.fsencode(opts)),
           "mount overlay at %s" % target)


def mount_tmpfs(target, opts, flags=0):
    """Mount a tmpfs with ``opts`` (e.g. ``"size=1m,mode=711"``) at ``target``."""
    _check(libc().mount(b"tmpfs", os.fsencode(target), b"tmpfs", flags, os.fsencode(opts)),
           "mount tmpfs at %s" % target)


def mount_overlay_readonly(lowers, target):
    """A read-only overlay of ``lowers`` (``a:b:...``, top first) at ``target``."""
    _check(libc().mount(b"overlay", os.fsencode(target), b"overlay", MS_RDONLY,
                        os.fsencode("lowerdir=%s" % lowers)), "mount overlay at %s" % target)


def umount(target):
    """Detach ``target`` (lazily: processes that still use it keep it until they exit)."""
    if libc().umount2(os.fsencode(target), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # not mounted
            raise OSError(err, "umount %s: %s" % (target, os.strerror(err)))


class FsCreds:
    """Run file operations with a slot's filesystem uid/gid (this thread only).

    ``setfsuid`` is per thread; while it is not 0 the kernel also drops the thread's
    file capabilities (``CAP_DAC_OVERRIDE``, ``CAP_CHOWN``, ...), so permission checks are
    the slot's own. Both are restored on exit.
    """

    def __init__(self, uid, gid):
        self.uid = uid
        self.gid = gid

    def __enter__(self):
        lib = libc()
        lib.setfsgid(self.gid)
        lib.setfsuid(self.uid)
        return self

    def __exit__(self, *exc):
        lib = libc()
        lib.setfsuid(0)
        lib.setfsgid(0)
        return False
