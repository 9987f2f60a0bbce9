"""Emptied layer directories, kept for the next layers of a sandbox's slots.

A reset drops the slot's writable layer (:meth:`.rootfs.SlotRoot.retire`) and the next
tenant gets a new one: a layer directory holding ``upper``, ``work`` and ``merged``. Making
one is four ``mkdir``, and overlay makes three more in ``work`` (``work/work`` and the
``incompat/volatile`` mark of a volatile mount); deleting it is seven ``rmdir``. On ext4
without a journal each new inode also scans past the inodes freed in the last seconds
(``recently_deleted``): at hundreds of resets a second that is most of the work.

So a dropped layer's directories are kept, up to :data:`KEEP` per sandbox, for a later
layer of any slot of the sandbox: its ``upper`` (all the tenant wrote) is deleted, as
before, and made anew when the directories are used again; ``work`` (overlay's own,
root-only) is emptied; the layer directory (chowned to its new slot), ``work`` and
``merged`` (the mount point: nothing is ever written under it) are reused, three of the
seven directories. No slot can reach any of the three, so a reused one holds nothing of
an earlier tenant.

Stdlib-only, Python 3.8.
"""

import os
import threading

from . import trees

#: Emptied layer directories a sandbox keeps (three directories each: a few KiB of disk).
KEEP = 8
#: What a plain dropped layer holds (one mount, no frozen layers below it); anything else
#: is deleted whole.
SHAPE = frozenset(("upper", "work", "merged"))


class LayerSpares:
    """A sandbox's kept layer directories, in ``path`` (on the layers' file system, so a
    ``rename`` moves one). Thread-safe: layers are built and dropped in worker threads."""

    def __init__(self, path):
        self.path = path
        self._names = []
        self._seq = 0
        self._lock = threading.Lock()

    def __len__(self):
        return len(self._names)

    def keep(self, dropped):
        """Delete what the tenant wrote in ``dropped`` (an unmounted layer directory, moved
        to the trash) and keep the rest, or delete it all when :data:`KEEP` are kept or it
        is not a plain layer. Returns whether it was kept. Slow (linear in what the tenant
        wrote): call it from a worker thread."""
        with self._lock:
            room = len(self._names) < KEEP
        try:
            plain = room and set(os.listdir(dropped)) == SHAPE and all(
                _is_dir(os.path.join(dropped, name)) for name in SHAPE)
        except OSError:
            plain = False
        if not plain:
            trees.remove_tree(dropped)
            return False
        trees.remove_tree(os.path.join(dropped, "upper"))
        # overlay's own: ``work/work`` and the ``incompat/volatile`` mark of a volatile
        # mount, which a new mount on this ``work`` refuses (EINVAL) while it is there
        trees.empty_dir(os.path.join(dropped, "work"))
        with self._lock:
            self._seq += 1
            name = "%d" % self._seq
            os.rename(dropped, os.path.join(self.path, name))
            self._names.append(name)
        return True

    def take(self, dest, uid, gid):
        """Move a kept layer directory to ``dest`` (owned by ``uid:gid``, mode 0700, with a
        new empty ``upper``); False when none is kept."""
        with self._lock:
            if not self._names:
                return False
            name = self._names.pop()
        os.rename(os.path.join(self.path, name), dest)
        os.chown(dest, uid, gid)
        os.chmod(dest, 0o700)
        os.mkdir(os.path.join(dest, "upper"), 0o700)
        return True


def _is_dir(path):
    return os.path.isdir(path) and not os.path.islink(path)
