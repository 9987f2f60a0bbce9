"""One size-capped tmpfs per slot for all its memory-backed writable places.

Without cgroups (``limits == "rlimit"``, as in Modal's containers) nothing charges tmpfs
pages to a slot, so a cap per mount is no slot total: seven places of ``tmpfs_mb`` each
let one slot hold seven times its share. Here the agent (root, in a mount namespace of
its own, so nothing leaks onto the host if it dies) mounts one tmpfs of ``tmpfs_mb``
per slot and bwrap binds a directory of it at each of :data:`.isolation.WRITABLE_TMPFS`:
the kernel's size limit is then the slot's total. A reset mounts a fresh one (O(1),
whatever the slot wrote). Stdlib-only (Python 3.8).
"""

import ctypes
import os

from . import mounts

MS_NOSUID, MS_NODEV = 0x2, 0x4

#: The directory of the slot's tmpfs bound at each writable place.
SUBDIRS = {"/dev/shm": "shm", "/tmp": "tmp", "/run": "run", "/home": "home", "/root": "root",
           "/mnt": "mnt", "/var/tmp": "var-tmp"}


def plan(agent, limit_mode):
    """How a slot's memory-backed places are capped as a total without cgroups.

    Sets ``agent.contain_root`` (a layered root's slot loses ``CAP_SYS_ADMIN`` and user
    namespaces: see :func:`.isolation.bwrap_root_argv`) and returns ``(root, note)``:
    ``root`` is where the slots' tmpfs are mounted (workspace-only slots under bwrap),
    or None (with cgroups, which charge tmpfs pages to the slot, or when the agent
    cannot mount: ``note`` says why).
    """
    agent.contain_root = False
    if limit_mode != "rlimit" or not agent.tmpfs_mb or agent.isolation != "bwrap":
        return None, ""
    if agent.filesystem == "overlay":
        agent.contain_root = True
        return None, ""
    root = os.path.join(agent.state_dir, "tmpfs")
    why = probe(root)
    return (None, why) if why else (root, "")


def probe(root):
    """Can the agent mount a capped tmpfs here? Moves it into a private mount namespace
    (which it keeps). Returns ``""`` when it can, else why not."""
    if os.geteuid() != 0:
        return "the agent is not root"
    try:
        mounts.enter_private_mount_namespace()
        os.makedirs(root, mode=0o711, exist_ok=True)
        test = os.path.join(root, "probe")
        os.makedirs(test, exist_ok=True)
        mount_tmpfs(test, 1)
        mounts.umount(test)
        os.rmdir(test)
    except OSError as exc:
        return "cannot mount a tmpfs: %s" % (exc.strerror or exc,)
    return ""


def mount_tmpfs(target, size_mb):
    """Mount a tmpfs of at most ``size_mb`` MiB (nosuid, nodev) at ``target``.

    Raises:
        OSError: the mount failed (errno and ``target`` in the message).
    """
    opts = "size=%dm,mode=0711" % int(size_mb)
    if mounts.libc().mount(b"tmpfs", os.fsencode(target), b"tmpfs", MS_NOSUID | MS_NODEV,
                           opts.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "mount tmpfs (%s) at %s: %s" % (opts, target, os.strerror(err)))


class SlotTmpfs:
    """The tmpfs of one slot at ``root/slot_N``, ``size_mb`` MiB, its places owned by
    root with the sticky bit (``1777``, like ``/tmp``), so the slot cannot move the mount
    point bwrap makes in ``/run`` for the control directory."""

    def __init__(self, root, index, size_mb):
        self.path = os.path.join(root, "slot_%d" % index)
        self.size_mb = int(size_mb)
        self.mounted = False

    def place(self, target):
        """The host directory bound at ``target`` (one of :data:`SUBDIRS`)."""
        return os.path.join(self.path, SUBDIRS[target])

    def ensure(self):
        """Mount the slot's tmpfs if it is not (blocking: a mount and a few mkdirs)."""
        if self.mounted:
            return
        os.makedirs(self.path, mode=0o711, exist_ok=True)
        mount_tmpfs(self.path, self.size_mb)
        self.mounted = True
        os.chmod(self.path, 0o711)
        for sub in SUBDIRS.values():
            os.mkdir(os.path.join(self.path, sub), 0o755)
            os.chmod(os.path.join(self.path, sub), 0o1777)
        os.mkdir(os.path.join(self.path, "run", "hmt"), 0o755)  # the control dir's mount point

    def renew(self):
        """A fresh, empty tmpfs (the old one is detached; whatever still used it is gone
        by now: the reset ended the slot's processes first)."""
        self.release()
        self.ensure()

    def release(self):
        if self.mounted:
            mounts.umount(self.path)
            self.mounted = False
