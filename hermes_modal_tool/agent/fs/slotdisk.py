"""The ``slot_disk`` limit enforced by the kernel: each writable layer on a file system of
its own, of ``slot_disk`` MiB and a fixed number of inodes.

Stdlib-only, Python 3.8.

Why not a project quota on one shared file system: it needs the kernel's quota support
(``CONFIG_QUOTA`` with ``CONFIG_QFMT_V2`` for ext4, ``CONFIG_XFS_QUOTA`` for xfs), which
kernels built for VMs and containers often lack (this one does: ext4 made with
``-O quota,project`` and xfs mounted with ``prjquota`` are both refused). A file system
per layer needs only loop devices and ext4, and its cap is its size:

- once per sandbox, ``mkfs.ext4`` makes a *template* image of ``slot_disk`` MiB (no
  journal: a layer is thrown away, never recovered; no reserved blocks; one inode per
  :data:`BYTES_PER_INODE`) in the agent's state directory. It is sparse: ~50-250 KiB of
  metadata, the rest holes;
- per layer (each tenant of each slot, each fork): a new sparse file, the template's data
  copied into it (a few ``pread``/``pwrite``), a loop device for it (``LOOP_CTL_GET_FREE``
  then ``LOOP_CONFIGURE`` with ``LO_FLAGS_AUTOCLEAR``), ext4 mounted from it as a
  *detached* mount (``fsopen``/``fsmount``: in no mount namespace, so the slots' ``bwrap``,
  which copies the agent's namespace at every start, has no more mounts to copy), held by
  a close-on-exec descriptor; the file is unlinked at once. The layer's ``upper`` and
  ``work`` (overlayfs needs both on one file system) are made in it through
  ``/proc/self/fd/N``;
- a write past the size fails in the slot with ``ENOSPC``, a file past the inode count
  too; the host's file system holds only what the layers hold (sparse files), and each
  neighbour has a file system of its own;
- dropping the layer unmounts its overlay and closes the descriptor: the kernel frees the
  file system, detaches the loop device and frees the unlinked file, O(1) in what the
  tenant wrote (nothing is walked).

If the agent dies, the kernel does the same for every layer (its descriptors close, its
private mount namespace goes). Where this cannot work (not root, no ``/dev/loop-control``,
no ``mkfs.ext4``, a mount refused) :func:`probe` says why and ``slot_disk`` is watched
(:mod:`.diskwatch`).
"""

import concurrent.futures
import ctypes
import errno
import fcntl
import os
import random
import shutil
import struct
import subprocess
import threading
import time

from . import mounts, trees

LOOP_CTL_GET_FREE = 0x4C82
#: How long :func:`attach_loop` keeps asking for a free loop device while others take them.
LOOP_ATTACH_S = 10.0
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_AUTOCLEAR = 4
#: ``struct loop_config``: fd, block_size, ``struct loop_info64`` (232 bytes), 8 reserved u64.
_LOOP_CONFIG = struct.Struct("=II232s64s")
_LO_FLAGS_OFFSET = 5 * 8 + 3 * 4  # lo_flags in struct loop_info64

SYS_FSOPEN, SYS_FSCONFIG, SYS_FSMOUNT = 430, 431, 432  # the same on every architecture
FSOPEN_CLOEXEC = FSMOUNT_CLOEXEC = 1
FSCONFIG_SET_FLAG, FSCONFIG_SET_STRING, FSCONFIG_CMD_CREATE = 0, 1, 6
#: ext4's options: no zeroing of inode tables in the background (never-used ones read as
#: empty anyway) and no cache flushes (nothing of a layer outlives the agent).
MOUNT_FLAGS = (b"noinit_itable",)
MOUNT_STRINGS = ((b"barrier", b"0"),)

#: Bytes of a layer per inode (ext4's own default for small file systems is 4 KiB; the
#: host's is 16 KiB). A 64 MiB layer holds 8,192 files.
BYTES_PER_INODE = 8192
#: The smallest layer file system (MiB): ext4's metadata takes a few MiB.
MIN_MB = 8


def inodes_for(size_mb):
    """The inode count of a layer of ``size_mb`` MiB (at least 1,024)."""
    return max(1024, int(size_mb) * 1024 * 1024 // BYTES_PER_INODE)


class LayerDisks:
    """The sandbox's layer file systems: a template image, and one detached ext4 mount per
    writable layer, held by a file descriptor (:meth:`attach`).

    A detached mount is in no mount namespace: the slots' ``bwrap`` copies the agent's
    namespace at every shell start, at a cost that grows with its mounts (~0.5 ms of
    waiting per mount per start here), so the layers' file systems add none. The agent
    reaches one through ``/proc/self/fd/N`` (:func:`fd_path`): overlayfs takes its
    ``upperdir`` and ``workdir`` there, and keeps the file system alive while mounted.
    A frozen layer (a snapshot) is attached at its directory instead (:meth:`attach_at`).

    ``path``: a root-only directory on the host's disk (the agent's state directory);
    ``size_mb``: each layer's size. Thread-safe: layers are built and dropped in worker
    threads.
    """

    def __init__(self, path, size_mb):
        self.path = path
        self.size_mb = int(size_mb)
        self.inodes = inodes_for(size_mb)
        self.template = os.path.join(path, "template.img")
        self._extents = None  # [(offset, bytes)] of the template's data
        self._seq = 0
        self._fds = set()  # detached mounts held
        self._attached = set()  # frozen layers' mount points
        self._base = None  # (bytes, inodes) an empty one uses
        self._lock = threading.Lock()

    def prepare(self):
        """Make the template image (blocking: one ``mkfs.ext4``, ~0.1-0.3 s of waiting).

        Raises:
            OSError: no ``mkfs.ext4``, or it failed (its message in the error).
        """
        mkfs = shutil.which("mkfs.ext4", path=os.environ.get("PATH", "") + ":/sbin:/usr/sbin")
        if mkfs is None:
            raise OSError(errno.ENOENT, "no mkfs.ext4 on PATH, /sbin or /usr/sbin")
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        os.chmod(self.path, 0o700)
        with open(self.template, "wb") as f:
            f.truncate(self.size_mb * 1024 * 1024)
        proc = subprocess.run(
            [mkfs, "-q", "-F", "-t", "ext4", "-O", "^has_journal,^resize_inode", "-m", "0",
             "-N", str(self.inodes), "-E", "lazy_itable_init=1,nodiscard,root_owner=0:0",
             self.template], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, timeout=60)
        if proc.returncode != 0:
            raise OSError(errno.EIO, "mkfs.ext4 failed (exit %d): %s" % (
                proc.returncode, proc.stdout.decode("utf-8", "replace").strip()[-300:]))
        self._extents = _data_extents(self.template)

    def attach(self, uid=0, gid=0):
        """A new, empty layer file system as a detached mount: its file descriptor
        (close-on-exec), root owned by ``uid:gid``, mode 0700. Blocking (a file of a few
        data blocks, two ioctls, the mount: 10-50 ms, most of it waiting on the kernel).
        Release it with :meth:`release`. Raises OSError (the step and errno in it)."""
        with self._lock:
            self._seq += 1
            name = os.path.join(self.path, "layer-%d.img" % self._seq)
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.unlink(name)  # nothing on the host's tree: freed when the loop device goes
            os.ftruncate(fd, self.size_mb * 1024 * 1024)
            src = os.open(self.template, os.O_RDONLY | os.O_CLOEXEC)
            try:
                for off, length in self._extents:
                    os.pwrite(fd, os.pread(src, length, off), off)
            finally:
                os.close(src)
            dev, lfd = attach_loop(fd)
        finally:
            os.close(fd)
        try:  # mounted before the device is closed: with AUTOCLEAR the last close detaches it
            mfd = fs_mount_detached(dev)
        finally:
            os.close(lfd)
        with self._lock:
            self._fds.add(mfd)
        try:
            root = fd_path(mfd)
            os.rmdir(os.path.join(root, "lost+found"))  # fsck's; no fsck runs on a layer
            os.chown(root, uid, gid)
            os.chmod(root, 0o700)
            if self._base is None:
                self._base = _used(root)
        except OSError:
            self.release(mfd)
            raise
        return mfd

    def release(self, mfd):
        """Let the layer file system held by ``mfd`` go (unmount its overlay first): the
        kernel frees it, its loop device and its file once nothing uses it."""
        with self._lock:
            if mfd not in self._fds:
                return
            self._fds.discard(mfd)
        os.close(mfd)

    def attach_at(self, mfd, path):
        """Attach the detached layer file system ``mfd`` at ``path`` (a frozen layer's
        directory, kept while the snapshot is) and release the descriptor."""
        mounts.move_mount_fd(mfd, path)
        with self._lock:
            self._attached.add(path)
        self.release(mfd)

    def owns(self, path):
        """Whether a frozen layer's file system of ours is attached at ``path``."""
        with self._lock:
            return path in self._attached

    def detach(self, path):
        """Unmount the frozen layer's file system at ``path`` (lazily)."""
        with self._lock:
            self._attached.discard(path)
        _quiet_umount(path)

    def used(self, mfd):
        """``(bytes, inodes)`` the layer file system ``mfd`` holds beyond an empty one's
        (``statvfs``: deleted files still open count)."""
        b, i = _used(fd_path(mfd))
        return b - self._base[0], i - self._base[1]

    def full(self, mfd):
        """Whether the layer file system ``mfd`` is (nearly) full: under 1 MiB or no inode
        left. O(1): one ``fstatfs`` of the descriptor itself (a path through
        ``/proc/self/fd`` cost four times as much: a walk of procfs and its checks, ~5 µs
        against ~1.5 µs here), cheap enough for the event loop."""
        try:
            st = os.statvfs(mfd)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < 1048576 or st.f_favail == 0

    def close(self, threads=8):
        """Let every layer file system of ours go (the agent is stopping), ``threads`` at a
        time: each waits 5-150 ms on the kernel, little of it CPU."""
        with self._lock:
            fds, self._fds = sorted(self._fds), set()
            attached, self._attached = sorted(self._attached), set()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(os.close, fds))
            list(pool.map(_quiet_umount, attached))

    def describe(self):
        return {"mib": self.size_mb, "inodes": self.inodes}


def fd_path(mfd):
    """The agent's path to the root of the detached mount ``mfd``."""
    return "/proc/self/fd/%d" % mfd


def drop(disks, path):
    """Delete a dropped frozen layer's directory ``path``: its file system detached first
    when it has one of ``disks`` (a :class:`LayerDisks` or None). Blocking."""
    if disks is not None and disks.owns(path):
        disks.detach(path)
    trees.remove_tree(path)


def fs_mount_detached(dev):
    """Mount the ext4 on ``dev`` as a detached mount (``fsopen``, ``fsconfig``, ``fsmount``);
    returns its close-on-exec file descriptor."""
    lib = mounts.libc()
    fs = _sys(lib.syscall(SYS_FSOPEN, b"ext4", FSOPEN_CLOEXEC), "fsopen ext4")
    try:
        _sys(lib.syscall(SYS_FSCONFIG, fs, FSCONFIG_SET_STRING, b"source", os.fsencode(dev), 0),
             "fsconfig source=%s" % dev)
        for key in MOUNT_FLAGS:
            _sys(lib.syscall(SYS_FSCONFIG, fs, FSCONFIG_SET_FLAG, key, None, 0), "fsconfig %s" % key)
        for key, value in MOUNT_STRINGS:
            _sys(lib.syscall(SYS_FSCONFIG, fs, FSCONFIG_SET_STRING, key, value, 0),
                 "fsconfig %s" % key)
        _sys(lib.syscall(SYS_FSCONFIG, fs, FSCONFIG_CMD_CREATE, None, None, 0),
             "mount ext4 (%s)" % dev)
        return _sys(lib.syscall(SYS_FSMOUNT, fs, FSMOUNT_CLOEXEC, 0), "fsmount %s" % dev)
    finally:
        os.close(fs)


def _sys(result, what):
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))
    return result


def _quiet_umount(path):
    try:
        mounts.umount(path)
    except OSError:
        pass


def _used(path):
    st = os.statvfs(path)
    return ((st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree)


def _data_extents(path):
    """``[(offset, length)]`` of ``path``'s data (``SEEK_DATA``/``SEEK_HOLE``), without
    the runs of zeros (a sparse copy stays sparse)."""
    out = []
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        end = os.fstat(fd).st_size
        off = 0
        while off < end:
            try:
                start = os.lseek(fd, off, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    break
                raise
            stop = os.lseek(fd, start, os.SEEK_HOLE)
            pos = start
            while pos < stop:
                n = min(1 << 20, stop - pos)
                data = os.pread(fd, n, pos)
                block = 4096
                for i in range(0, len(data), block):
                    chunk = data[i:i + block]
                    if chunk.count(0) != len(chunk):
                        if out and out[-1][0] + out[-1][1] == pos + i:
                            out[-1] = (out[-1][0], out[-1][1] + len(chunk))
                        else:
                            out.append((pos + i, len(chunk)))
                pos += n
            off = stop
    finally:
        os.close(fd)
    return out


def attach_loop(fd):
    """A free loop device backed by the open file ``fd``, detached by the kernel when its
    last user goes (``LO_FLAGS_AUTOCLEAR``). Returns ``(path, fd)``: keep ``fd`` open until
    the device is mounted (closing it first detaches the device at once)."""
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        info = bytearray(232)
        struct.pack_into("=I", info, _LO_FLAGS_OFFSET, LO_FLAGS_AUTOCLEAR)
        cfg = _LOOP_CONFIG.pack(fd, 0, bytes(info), bytes(64))
        # Every agent (and each of its threads) asks for the same first free device at
        # once: all but one get EBUSY and ask again. Under many concurrent slot starts
        # (32 sandboxes starting 128 slots) a fixed count of tries ran out; a bounded time
        # with a random back-off that grows with the tries spreads the contenders.
        deadline = time.monotonic() + LOOP_ATTACH_S
        tries = 0
        while True:
            n = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
            dev = "/dev/loop%d" % n
            try:
                lfd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                raise OSError(errno.ENOENT, "%s does not exist (a /dev without the kernel's "
                                            "device nodes)" % dev) from None
            try:
                fcntl.ioctl(lfd, LOOP_CONFIGURE, cfg)
                return dev, lfd
            except OSError as exc:
                os.close(lfd)
                if exc.errno != errno.EBUSY:
                    raise OSError(exc.errno, "LOOP_CONFIGURE %s: %s" % (dev, exc.strerror)) from None
            tries += 1
            if time.monotonic() > deadline:
                raise OSError(errno.EBUSY, "no free loop device after %d tries in %gs (other "
                                           "processes took each one first)" % (tries, LOOP_ATTACH_S))
            time.sleep(random.random() * min(0.0005 * tries, 0.02))
    finally:
        os.close(ctl)


def plan(agent, cfg):
    """The slots' disk limit: ``(disks, size_mb, default, note)``.

    ``size_mb`` is the profile's ``slot_disk``, or, without one, a fair share of the free
    disk where the agent's state is (``statvfs``: what an unprivileged user may still
    write, divided by the sandbox's slots; at least :data:`MIN_MB`), the way ``slot_memory``
    defaults to a share of ``memory``; ``default`` says which. ``disks`` is a
    :class:`LayerDisks` when each layer gets a file system of that size (a layered root
    and :func:`probe` passes), else None and ``note`` says why (the limit is then watched
    where ``slot_disk`` is set: :mod:`.diskwatch`; a default is not watched).
    """
    size = cfg.get("slot_disk") or None
    wanted = cfg.get("disk_limit") or "auto"
    if wanted == "watch":
        return None, size, False, "the profile asks for disk_limit: watch"
    why = None
    if agent.filesystem != "overlay":
        why = "no layered root (%s)" % (
            "slots run without bubblewrap" if agent.isolation != "bwrap" else "workspace-only")
    if why:
        if wanted == "kernel":
            raise RuntimeError("disk_limit: kernel is not possible here: %s" % why)
        return None, size, False, why
    note = "the profile's slot_disk"
    if size is None:
        st = os.statvfs(agent.state_dir)
        free = st.f_bavail * st.f_frsize // 1048576
        size = max(MIN_MB, free // int(cfg["slots"]))
        note = ("a fair share of the free disk where the sandbox keeps its state (%d MiB "
                "free at its start, %d slots); set slot_disk to choose" % (free, int(cfg["slots"])))
    disks, why = probe(os.path.join(agent.state_dir, "disk"), size)
    if why and wanted == "kernel":
        raise RuntimeError("disk_limit: kernel is not possible here: %s" % why)
    return disks, (cfg.get("slot_disk") or None) if why else size, \
        cfg.get("slot_disk") is None, why or note


def probe(path, size_mb):
    """Can each layer get a file system of its own here? Returns ``(disks, "")`` with a
    prepared :class:`LayerDisks`, or ``(None, why)``."""
    if os.geteuid() != 0:
        return None, "the agent is not root"
    if not os.path.exists("/dev/loop-control"):
        return None, "no /dev/loop-control (loop devices)"
    disks = LayerDisks(path, max(MIN_MB, int(size_mb)))
    try:
        disks.prepare()
        disks.release(disks.attach())
    except (OSError, subprocess.SubprocessError) as exc:
        disks.close()
        return None, "no loop-mounted file system per layer: %s" % (exc,)
    return disks, ""
