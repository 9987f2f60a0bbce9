"""Each sandbox's ``/dev/shm``: memory-backed (a tmpfs), as on Modal.

The server (real root, with bwrap containers) mounts one tmpfs per sandbox on the host at
``<state>/sandboxes/<id>/fs/shm`` (mount source :data:`SOURCE`, so that
``grep modal-local-shm /proc/self/mountinfo`` finds every one), sized to the sandbox's
``memory`` (its hard limit if given, else the requested MiB), else :func:`default_mib`
(half the host's RAM, like Docker's and Linux's own ``/dev/shm`` default). Every exec of
the sandbox binds it at ``/dev/shm`` (shared by its execs). It is detached when the
sandbox finishes, and :func:`unmount_under` detaches any left under a state directory
(the server's stop). Without root or bwrap ``fs/shm`` stays a plain directory on disk.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from ...agent.fs import mounts

#: The mount source of every sandbox's ``/dev/shm`` tmpfs (as shown in ``/proc/*/mountinfo``).
SOURCE = "modal-local-shm"
_MS_NOSUID, _MS_NODEV = 2, 4


def default_mib() -> int:
    """Half the host's RAM, MiB (the size of a sandbox's ``/dev/shm`` without ``memory``)."""
    return max(64, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2 // 1048576)


def size_mib(memory_mib: int | None, memory_limit_mib: int | None) -> int:
    """The size of a sandbox's ``/dev/shm`` (MiB): its memory limit, else its requested
    memory, else :func:`default_mib`."""
    return int(memory_limit_mib or memory_mib or default_mib())


def mount_shm(path: Path, mib: int) -> None:
    """Mount a tmpfs of ``mib`` MiB (mode 1777) at ``path`` (an empty directory).

    Raises:
        OSError: the mount failed (e.g. not root).
    """
    opts = f"size={int(mib)}m,mode=1777"
    flags = _MS_NOSUID | _MS_NODEV
    if mounts.libc().mount(SOURCE.encode(), os.fsencode(path), b"tmpfs", flags, opts.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs ({opts}, nosuid, nodev) at {path}: {os.strerror(err)}")


def unmount_shm(path: Path) -> None:
    """Detach the tmpfs at ``path`` if one of ours is mounted there (lazily: a process
    that still uses it keeps it until it exits; its memory is freed then)."""
    if _mounted_at(str(path)):
        mounts.umount(str(path))


def unmount_under(top: Path) -> list[str]:
    """Detach every sandbox ``/dev/shm`` tmpfs mounted under ``top`` (a leftover of a
    sandbox that was not finished); returns the mount points detached."""
    prefix = str(top).rstrip("/") + "/"
    done = []
    for point in _our_mounts():
        if point.startswith(prefix):
            mounts.umount(point)
            done.append(point)
    return done


def _our_mounts() -> list[str]:
    points = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
            for line in fh:
                fields = line.split()
                sep = fields.index("-")
                if fields[sep + 1] == "tmpfs" and fields[sep + 2] == SOURCE:
                    points.append(fields[4].replace("\\040", " ").replace("\\011", "\t")
                                  .replace("\\012", "\n").replace("\\134", "\\"))
    except OSError:
        pass
    return points


def _mounted_at(path: str) -> bool:
    return path in _our_mounts()
