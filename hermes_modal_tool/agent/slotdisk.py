"""The ``slot_disk`` limit enforced by the kernel: each writable layer on a file system of
its own, of ``slot_disk`` MiB and a fixed number of inodes.

Stdlib-only, Python 3.8.

Why not a project quota on one shared file system: it needs the kernel's quota support
(``CONFIG_QUOTA`` with ``CONFIG_QFMT_V2`` for ext4, ``CONFIG_XFS_QUOTA`` for xfs), which
kernels built for VMs and containers often lack (this one does: ext4 with
``-O quota,project`` and xfs with ``prjquota`` both refuse to mount). A file system per
layer needs only loop devices and ext4, and its cap is its size:

- once per sandbox, ``mkfs.ext4`` makes a *template* image of ``slot_disk`` MiB (no
  journal: a layer is thrown away, never recovered; no reserved blocks; one inode per
  :data:`BYTES_PER_INODE`), in the agent's state directory. It is sparse: about 50 KiB of
  metadata, the rest holes;
- per layer (each tenant of each slot, and each fork's layer): a new sparse file, the
  template's data copied into it (a few ``pread``/``pwrite``), a loop device for it
  (``LOOP_CTL_GET_FREE`` then ``LOOP_CONFIGURE`` with ``LO_FLAGS_AUTOCLEAR``), mounted at
  the layer's directory; the file is unlinked at once. The layer's ``upper`` and ``work``
  (overlayfs needs both on one file system) are made in it.
- a write past the size fails in the slot with ``ENOSPC``, a file past the inode count
  too; the host's file system only ever holds what the layers hold (sparse files), and
  the slot's neighbours have file systems of their own.
- dropping the layer unmounts it (lazily); the last reference gone, the loop device
  detaches itself and the unlinked file's blocks are freed: O(1) in what the tenant wrote.

Every mount is in the agent's private mount namespace (:func:`.mounts.enter_private_mount_namespace`):
if the agent dies, the kernel unmounts them all and the files (already unlinked) go.

Where this cannot work (not root, no ``/dev/loop-control``, no ``mkfs.ext4``, a mount
refused) :func:`probe` says why and the limit is watched (:mod:`.diskwatch`).
"""

import concurrent.futures
import ctypes
import errno
import fcntl
import os
import shutil
import struct
import subprocess
import threading

from . import mounts, trees

LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_AUTOCLEAR = 4
#: ``struct loop_config``: fd, block_size, ``struct loop_info64`` (232 bytes), 8 reserved u64.
_LOOP_CONFIG = struct.Struct("=II232s64s")
_LO_FLAGS_OFFSET = 5 * 8 + 3 * 4  # lo_flags in struct loop_info64

MS_MOVE = 8192
FITRIM = 0xC0185879
#: ext4's options: no zeroing of inode tables in the background (never-used ones read as
#: empty anyway) and no cache flushes (nothing of a layer outlives the agent).
MOUNT_OPTS = b"noinit_itable,barrier=0"
#: Emptied layer file systems a sandbox keeps mounted for its next layers.
KEEP = 8

#: Bytes of a layer per inode (ext4's own default for small file systems is 4 KiB; the
#: host's is 16 KiB). A 64 MiB layer holds 8,192 files.
BYTES_PER_INODE = 8192
#: The smallest layer file system (MiB): ext4's metadata takes a few MiB.
MIN_MB = 8


def inodes_for(size_mb):
    """The inode count of a layer of ``size_mb`` MiB (at least 1,024)."""
    return max(1024, int(size_mb) * 1024 * 1024 // BYTES_PER_INODE)


class LayerDisks:
    """The sandbox's layer file systems: a template image, and emptied file systems kept
    mounted for the next layers (:data:`KEEP`), so a reset in steady state neither mounts
    nor unmounts one (each costs 10-150 ms of waiting on the kernel, ~1.5 ms of CPU).

    ``path``: a root-only directory on the host's disk (the agent's state directory);
    ``size_mb``: each layer's size. Thread-safe: layers are built and dropped in worker
    threads.
    """

    def __init__(self, path, size_mb, keep=KEEP):
        self.path = path
        self.size_mb = int(size_mb)
        self.inodes = inodes_for(size_mb)
        self.keep = keep
        self.template = os.path.join(path, "template.img")
        self._extents = None  # [(offset, bytes)] of the template's data
        self._seq = 0
        self._clean = []  # mount points in path/pool holding an empty file system
        self._live = set()  # every mount point of ours that holds one (pool included)
        self._base = None  # (blocks, inodes) an empty one uses
        self._lock = threading.Lock()

    def prepare(self):
        """Make the template image (blocking: one ``mkfs.ext4``, ~0.1-0.3 s of waiting).

        Raises:
            OSError: no ``mkfs.ext4``, or it failed (its message in the error).
        """
        mkfs = shutil.which("mkfs.ext4", path=os.environ.get("PATH", "") + ":/sbin:/usr/sbin")
        if mkfs is None:
            raise OSError(errno.ENOENT, "no mkfs.ext4 on PATH, /sbin or /usr/sbin")
        for sub in ("", "pool", "dirty"):
            os.makedirs(os.path.join(self.path, sub), mode=0o700, exist_ok=True)
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

    def _name(self, sub):
        with self._lock:
            self._seq += 1
            return os.path.join(self.path, sub, "%d" % self._seq)

    def _mount_new(self, target):
        """Mount a new, empty layer file system at ``target`` (an existing directory)."""
        name = self._name("") + ".img"
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
            _mount(dev, target, b"ext4", 0, MOUNT_OPTS)
        finally:
            os.close(lfd)
        with self._lock:
            self._live.add(target)
        _rmdir(os.path.join(target, "lost+found"))  # fsck's; no fsck ever runs on a layer
        os.chmod(target, 0o700)
        if self._base is None:
            self._base = _used(target)

    def take(self, target):
        """Mount an empty layer file system at ``target`` (an existing, empty directory):
        a kept one (moved there) or a new one. Its root is owned by root, mode 0700.

        Blocking. Raises OSError (the step and the errno in the message).
        """
        with self._lock:
            src = self._clean.pop() if self._clean else None
        if src is None:
            self._mount_new(target)
            return
        try:
            _mount(src, target, None, MS_MOVE, None)
        except OSError:
            self._unmount(src)
            raise
        with self._lock:
            self._live.discard(src)
            self._live.add(target)
        _rmdir(src)

    def owns(self, path):
        with self._lock:
            return path in self._live

    def used(self, path):
        """``(bytes, inodes)`` the file system mounted at ``path`` holds beyond an empty
        one's (``statvfs``: deleted files still open count)."""
        b, i = _used(path)
        return b - self._base[0], i - self._base[1]

    def full(self, path):
        """Whether the layer file system at ``path`` is (nearly) full: under 1 MiB or no
        inode left. O(1) (``statvfs``), cheap enough for the event loop."""
        try:
            st = os.statvfs(path)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < 1048576 or st.f_favail == 0

    def recycle(self, path):
        """Drop the layer file system mounted at ``path`` (nothing else mounted in it; no
        process of the slot left): empty it and keep it for a later layer, or unmount it
        (the loop device and its file go with it). ``path`` is removed. Blocking, linear
        in what the tenant left (as deleting a layer's tree always was); call it from a
        worker thread."""
        dirty = self._name("dirty")
        os.mkdir(dirty, 0o700)
        try:
            _mount(path, dirty, None, MS_MOVE, None)
        except OSError:
            _rmdir(dirty)
            self._unmount(path)
            _rmdir(path)
            return
        with self._lock:
            self._live.discard(path)
            self._live.add(dirty)
        _rmdir(path)
        with self._lock:
            room = len(self._clean) < self.keep
        if room:
            try:
                trees.empty_dir(dirty)
                os.chown(dirty, 0, 0)
                os.chmod(dirty, 0o700)
                if _used(dirty) == self._base:  # nothing held open: as new
                    _trim(dirty)
                    clean = self._name("pool")
                    os.mkdir(clean, 0o700)
                    _mount(dirty, clean, None, MS_MOVE, None)
                    with self._lock:
                        self._live.discard(dirty)
                        self._live.add(clean)
                        self._clean.append(clean)
                    _rmdir(dirty)
                    return
            except OSError:
                pass
        self._unmount(dirty)
        _rmdir(dirty)

    def _unmount(self, path):
        with self._lock:
            self._live.discard(path)
        try:
            mounts.umount(path)
        except OSError:
            pass

    def close(self, threads=8):
        """Unmount every layer file system of ours (the agent is stopping), ``threads`` at
        a time: each waits 10-150 ms on the kernel, little of it CPU."""
        with self._lock:
            live, self._live, self._clean = sorted(self._live), set(), []
        if not live:
            return
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(_quiet_umount, live))

    def describe(self):
        return {"mib": self.size_mb, "inodes": self.inodes}


def drop(disks, path):
    """Delete a dropped layer directory ``path``: its file system recycled when it has one
    of ``disks`` (a :class:`LayerDisks` or None), else its tree removed. Blocking."""
    if disks is not None and disks.owns(path):
        disks.recycle(path)
    else:
        trees.remove_tree(path)


def _quiet_umount(path):
    try:
        mounts.umount(path)
    except OSError:
        pass


def _mount(source, target, fstype, flags, opts):
    if mounts.libc().mount(os.fsencode(source), os.fsencode(target), fstype, flags, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "mount %s at %s: %s" % (source, target, os.strerror(err)))


def _rmdir(path):
    try:
        os.rmdir(path)
    except OSError:
        pass


def _used(path):
    st = os.statvfs(path)
    return ((st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree)


def _trim(path):
    """Give the file system's free blocks back to the host (``FITRIM``: the loop device
    punches holes in its file)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, FITRIM, struct.pack("=QQQ", 0, 2 ** 64 - 1, 0))
    except OSError:
        pass
    finally:
        os.close(fd)


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
        for _ in range(64):  # another process may take the free one first (EBUSY)
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
        raise OSError(errno.EBUSY, "no free loop device after 64 tries")
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


def probe(path, size_mb, keep=KEEP):
    """Can each layer get a file system of its own here? Returns ``(disks, "")`` with a
    prepared :class:`LayerDisks` (one empty file system already mounted, kept for the
    first layer), or ``(None, why)``. The agent must already be in its private mount
    namespace (:func:`.rootprobe.probe`)."""
    if os.geteuid() != 0:
        return None, "the agent is not root"
    if not os.path.exists("/dev/loop-control"):
        return None, "no /dev/loop-control (loop devices)"
    disks = LayerDisks(path, max(MIN_MB, int(size_mb)), keep)
    try:
        disks.prepare()
        first = disks._name("pool")
        os.mkdir(first, 0o700)
        disks._mount_new(first)
        with disks._lock:
            disks._clean.append(first)
    except (OSError, subprocess.SubprocessError) as exc:
        disks.close()
        return None, "no loop-mounted file system per layer: %s" % (exc,)
    return disks, ""
