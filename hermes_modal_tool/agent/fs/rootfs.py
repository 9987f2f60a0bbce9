"""A slot's own copy-on-write root filesystem (overlayfs over an idmapped lower layer).

Stdlib-only, Python 3.8 (``ctypes`` for the mount syscalls Python does not wrap).

Each slot sees::

    upper     state/fs/slot_N/upper   private, writable, owned by the slot's uid; dropped on reset
    lower     the sandbox's root ("/"), read-only, idmapped so that its uid 0 shows as the
              slot's uid (inside the slot's user namespace: root)

How it is built (the agent must be real root; :func:`.rootprobe.probe` says whether it
works here):

- at ``init`` the agent moves into a mount namespace of its own and makes every mount in it
  private, so none of the mounts below is ever visible on (or propagated to) the host, and
  all of them vanish with the agent;
- per slot, once: a user namespace mapping 0 -> the slot's uid (a short-lived child makes it),
  then ``open_tree(OPEN_TREE_CLONE)`` of ``/`` and ``mount_setattr(MOUNT_ATTR_IDMAP |
  MOUNT_ATTR_RDONLY)``, attached with ``move_mount`` at ``state/mnt/slot_N``. Read-only: no
  path through it can change a host file;
- per sandbox, once: a *template* layer on the sandbox's small tmpfs (``state/tpl/shared``,
  :class:`.rootplan.SharedTemplate`), filled from a plan computed once (opaque empty
  ``/root``, ``/home``, ``/tmp``, ``/run`` ...; whiteouts hiding the agent's state, secrets
  and root-only host files; the workspaces' parent and the working directory; an apt
  setting for a one-uid namespace; the PEP 668 marker removed), owned by root; per slot,
  once, an idmapped mount of it in the slot's user namespace (``state/mnt/slot_N/tpl-0``),
  so the slot sees it as its own. It is the overlay's top lower, read-only, so every tenant
  starts from it without a file being written for it (on a journalled disk the ~40 entries
  cost tens of milliseconds per layer). A tmpfs is another file system, so it never
  overlaps the root's tree. The slot's workspace directory is made in each upper (two
  directories). Where the shared template cannot be used (an entry owned by another id
  than root's, an idmapped tmpfs refused), each slot fills a template of its own
  (``state/tpl/slot_N``, owned by its uid) from the plan;
- per tenant: a fresh, empty upper directory, then ``mount -t overlay`` with
  ``lowerdir=template:root`` at ``state/fs/slot_N/merged``. bwrap binds that as the slot's
  ``/``. With ``slot_disk`` enforced by the kernel (:mod:`.slotdisk`), upper and work are
  on a file system of the layer's own (a detached mount, ``/proc/self/fd/N``).

Reset unmounts the overlay and drops the upper (renamed into a trash directory, removed
later, off the event loop; or its own file system let go): its cost does not depend on
what the slot wrote.

Snapshots and forks (:mod:`.snapshots`): :meth:`SlotRoot.freeze` unmounts the layer in use
and keeps its directory as a frozen layer; :meth:`SlotRoot.build_on` stacks a new, empty
upper on frozen layers: ``lowerdir=frozen...:template:root view`` where each frozen upper is
idmapped to the slot's uid when another slot wrote it, and the root view is a read-only
overlay of the idmapped root (another file system: overlayfs refuses a lower inside
another lower's tree, and the frozen layers are inside the root's).

Where the kernel says no (not root, no ``open_tree``, overlay refused),
:func:`.rootprobe.probe` returns the reason and slots keep the workspace-only layout.
"""

import errno
import os
import threading

from . import slotdisk, trees
from .mounts import (
    MS_RDONLY,
    mount_idmapped,
    mount_overlay,
    mount_overlay_readonly,
    mount_tmpfs,
    umount,
    userns_fd,
)


class _Layer:
    """One writable layer set of a slot and where it is mounted: ``dir/upper``, ``dir/work``
    for ``/`` and ``dir/layers/N/...`` for the other mounts; ``dir/merged`` is the root."""

    def __init__(self, path, stack=None):
        self.dir = path
        self.merged = os.path.join(path, "merged")
        self.mounted = []  # overlay mount points, in mount order
        self.disk = None  # the detached file system of upper and work (.slotdisk), or None
        self.stack = stack  # the frozen layer (snapshot) this one sits on, or None
        self.lower_mounts = []  # idmapped mounts of frozen layers (unmounted after the overlays)
        self._dirs = {}

    def dirs(self, i):
        """``(upper, work)`` of mount ``i``."""
        got = self._dirs.get(i)
        if got is None:
            top = self.dir if self.disk is None else slotdisk.fd_path(self.disk)
            top = top if i == 0 else os.path.join(top, "layers", str(i))
            got = self._dirs[i] = (os.path.join(top, "upper"), os.path.join(top, "work"))
        return got


class SlotRoot:
    """One slot's layered root: its idmapped lower mounts and its writable layers.

    Blocking (mount syscalls, a fork): call from worker threads, never the event loop.

    Layers are double-buffered: besides the one in use, a *standby* layer is prepared in
    the background (:meth:`prepare_standby`), so a reset swaps to it without touching the
    file system: on a journalled file system holding much unwritten data (a tenant that
    installed 200 MB), even a ``mkdir`` or ``rename`` waits for the journal to flush it,
    tens to hundreds of milliseconds. The dropped layer is unmounted, renamed and deleted
    later (:meth:`retire`). ``base/current`` is a link to the layer in use (for people and
    tests; the agent never follows it). The idmapped lowers live in ``mnt``, outside every
    tree that is ever deleted.
    """

    def __init__(self, base, mnt, uid, gid, plan, trash, dirs=(), template=None, spares=None,
                 shared=None):
        self.base = base
        self.lower = mnt
        self.template = template  # this slot's own template layer (on the sandbox's tmpfs)
        self.shared = shared  # the sandbox's shared template (rootplan.SharedTemplate) or None
        self._tpl = []  # per plan mount: the template layer in use (shared, idmapped; or own)
        self._tpl_mounts = []  # this slot's idmapped mounts of the shared template
        self._own_dirs = []  # dirs the shared template lacks: made in each layer's upper
        self.uid = uid
        self.gid = gid
        self.plan = plan
        self.trash = trash
        self.spares = spares  # the sandbox's kept layer directories (.layerspares)
        self.disks = None  # the sandbox's layer file systems (.slotdisk.LayerDisks) or None
        self.dirs = list(dirs)
        self.active = None
        self.standby = None
        self._lowers = []  # attached idmapped lowers, one per plan mount
        self._seq = 0
        self._userns = {}  # on-disk owner uid -> user namespace fd mapping it to this slot's uid
        self._lock = threading.Lock()  # guards active/standby (held only for pointer swaps)
        self._lower_lock = threading.Lock()  # guards the lowers and layer numbering
        self._ns_lock = threading.Lock()  # guards _userns
        self._current_lock = threading.Lock()  # one update of base/current at a time
        self._views = {}  # mount index -> the root's read-only overlay view (for forks)
        self._view_mounts = []
        self._spread = False  # base marked: new layers are placed apart (retire)

    @property
    def merged(self):
        """The slot's ``/`` as the agent sees it (the layer in use)."""
        return self.active.merged if self.active is not None else os.path.join(self.base, "none")

    @property
    def mounted(self):
        return self.active is not None

    def ensure(self):
        """Mount the slot's root if it has none: the standby layer when one is ready (no
        file system work), else a new one. Returns whether it built one (then
        ``base/current`` is not yet updated: :meth:`point_current`)."""
        if self.swap():
            return False
        layer = self._build()
        with self._lock:
            if self.active is None:
                self.active = layer
                layer = None
        if layer is not None:  # another thread mounted one meanwhile
            self._keep_or_drop(layer)
        return True

    def swap(self):
        """Take the standby layer if the slot has none in use; True when it has one now.
        Only pointers change: safe (and instant) on the agent's event loop."""
        with self._lock:
            if self.active is None and self.standby is not None:
                self.active, self.standby = self.standby, None
            return self.active is not None

    def prepare_standby(self):
        """Prepare the next tenant's layer (background work: it may wait on the file
        system's journal)."""
        with self._lock:
            if self.standby is not None or not self._lowers:
                return
        self._keep_or_drop(self._build())
        try:
            for i in range(len(self.plan.mounts)):
                self._root_view(i)  # so that a fork of this slot has nothing more to mount
        except OSError:
            pass  # a fork of this slot tries again and reports why it cannot

    def _keep_or_drop(self, layer):
        with self._lock:
            if self.standby is None:
                self.standby = layer
                return
        self.retire(layer)

    def discard(self):
        """Stop using the slot's writable layer; return it for :meth:`retire` (or None).

        The slot's processes must be gone. No file system work: the next :meth:`ensure`
        takes the standby layer.
        """
        with self._lock:
            layer, self.active = self.active, None
            return layer

    def retire(self, layer):
        """Unmount a dropped layer and move it to the trash; return the path to delete (None
        when the layer had a file system of its own: the kernel frees it).

        The first one also marks ``base`` (:func:`.trees.spread_subdirs`): from then on,
        each new layer of the slot is made in a block group apart from the ones where
        the dropped layers' inodes are being freed. The slot's first layers are made
        beside ``base`` (itself placed apart from the other slots'), which spares each
        of them ext4's scan of every block group (the Orlov allocator's, about 10% of
        the agents' worker-thread CPU at 1,000 fresh slots on this machine's disk of
        2,048 groups: ``perf record``)."""
        if not self._spread:
            self._spread = True
            trees.spread_subdirs(self.base)
        _unmount_layer(layer)
        if layer.disk is not None:  # its own file system: the kernel frees it (.slotdisk)
            _release_disk(self.disks, layer)
            trees.remove_tree(layer.dir)  # ``merged`` (and a fork's ``lower``): a few rmdir
            return None
        dest = os.path.join(self.trash, "%s-%s" % (os.path.basename(self.base),
                                                   os.path.basename(layer.dir)))
        os.rename(layer.dir, dest)
        return dest

    def _attach_lowers(self):
        """Attach the idmapped lowers and fill the template once (caller holds
        ``_lower_lock``)."""
        if self._lowers:
            return
        os.makedirs(self.base, mode=0o700, exist_ok=True)
        os.chown(self.base, self.uid, self.gid)  # bwrap (as the slot) binds from here
        ns = userns_fd(self.uid, self.gid)
        try:
            lowers = []
            for i, mount in enumerate(self.plan.mounts):
                target = os.path.join(self.lower, str(i))
                os.makedirs(target, mode=0o700, exist_ok=True)
                mount_idmapped(self.plan.source_of(mount), target, ns)
                lowers.append(target)
            self._tpl = self._attach_template(ns)
            self._lowers = lowers
        finally:
            os.close(ns)

    def _attach_template(self, ns):
        """This slot's template layers, one per plan mount: the sandbox's shared template
        through idmapped mounts (user namespace ``ns``) in ``mnt`` (see
        :class:`.rootplan.SharedTemplate`), or, where there is none or it cannot be used,
        a copy of the slot's own in ``template``."""
        shared = self.shared
        if shared is not None and shared.broken is None:
            mounted = []
            try:
                for i, top in enumerate(shared.tops()):
                    target = os.path.join(self.lower, "tpl-%d" % i)
                    os.makedirs(target, mode=0o700, exist_ok=True)
                    mount_idmapped(top, target, ns)
                    mounted.append(target)
            except OSError as exc:
                for target in reversed(mounted):
                    umount(target)
                if shared.broken is None:
                    shared.refuse("an idmapped mount of it failed: %s" % (exc,))
            else:
                self._tpl_mounts = mounted
                self._own_dirs = [d for d in self.dirs if d and d != "/" and d not in shared.dirs]
                return mounted
        if os.path.isdir(self.template):
            return self.plan.template_tops(self.template)
        return self.plan.make_template(self.template, self.uid, self.gid, self.dirs)

    def _new_layer(self, stack=None):
        with self._lower_lock:
            self._attach_lowers()
            self._seq += 1
            layer = _Layer(os.path.join(self.base, "layer-%d" % self._seq), stack)
        if self.disks is not None:  # upper and work on a file system of their own (.slotdisk)
            os.mkdir(layer.dir, 0o700)
            layer.disk = self.disks.attach(self.uid, self.gid)
        elif stack is None and len(self.plan.mounts) == 1 and self.spares is not None \
                and self.spares.take(layer.dir, self.uid, self.gid):
            return layer
        else:
            os.mkdir(layer.dir, 0o700)
        os.chown(layer.dir, self.uid, self.gid)
        for i in range(len(self.plan.mounts)):
            upper, work = layer.dirs(i)
            if i:  # dir/layers/N
                os.makedirs(os.path.dirname(upper), mode=0o700, exist_ok=True)
            for path in (upper, work):
                os.mkdir(path, 0o700)
        return layer

    def _mount(self, layer, lowers, extra=None):
        """Mount the layer's overlays; ``lowers[i]`` is mount ``i``'s lowerdir option."""
        if not os.path.isdir(layer.merged):  # a reused layer directory has it
            os.mkdir(layer.merged, 0o755)
        try:
            for i, mount in enumerate(self.plan.mounts):
                upper, work = layer.dirs(i)
                target = layer.merged if mount == "/" else layer.merged + mount
                mount_overlay(lowers[i], upper, work, target, extra)
                layer.mounted.append(target)
        except OSError:
            _unmount_layer(layer)
            raise
        return layer

    def _template_of(self, i):
        return self._tpl[i]

    def _build(self):
        layer = self._new_layer()
        try:
            for i, mount in enumerate(self.plan.mounts):
                self.plan.own_upper(layer.dirs(i)[0], mount, self.uid, self.gid)
            if self._own_dirs:  # the slot's workspace (the shared template has the rest)
                self.plan.add_dirs({m: layer.dirs(i)[0] for i, m in enumerate(self.plan.mounts)},
                                   self.uid, self.gid, self._own_dirs)
            return self._mount(layer, ["%s:%s" % (self._template_of(i), lower)
                                       for i, lower in enumerate(self._lowers)])
        except OSError:
            _release_disk(self.disks, layer)
            trees.remove_tree(layer.dir)  # nothing is mounted on it (_mount unmounted it)
            raise

    # -- snapshots (see agent/state/snapshots.py) ------------------------------------------
    def build_on(self, chain, ws_from=None):
        """A new, empty writable layer stacked on frozen layers (not yet in use).

        ``chain`` is ``[(directory, owner uid on disk), ...]``, the top frozen layer first;
        each directory is a frozen layer's (``upper`` and ``layers/N/upper`` as in a
        layer). The overlay's lowers are those uppers (idmapped so that their owner shows as
        this slot's uid when another slot wrote them) over the sandbox's root, so the cost
        is a few mounts per frozen layer, whatever the size of the state. This slot's
        template goes between the frozen layers and the root (a snapshot holds only what
        its slot changed, so it can be restored into any slot or sandbox).
        """
        layer = self._new_layer(stack=True)
        try:
            per_mount = []
            for i, mount in enumerate(self.plan.mounts):
                upper = layer.dirs(i)[0]
                self.plan.own_upper(upper, mount, self.uid, self.gid)
                parts = []
                for k, (fdir, owner) in enumerate(chain):
                    src = _Layer(fdir).dirs(i)[0]
                    if owner == self.uid:
                        parts.append(src)
                        continue
                    target = os.path.join(layer.dir, "lower", "%d-%d" % (k, i))
                    os.makedirs(target, mode=0o700)
                    mount_idmapped(src, target, self._ns_for(owner))
                    layer.lower_mounts.append(target)
                    parts.append(target)
                parts.append(self._template_of(i))
                parts.append(self._root_view(i))
                per_mount.append(":".join(parts))
            uppers = {m: layer.dirs(i)[0] for i, m in enumerate(self.plan.mounts)}
            for d in self.dirs:  # this slot's own workspace and workdir (merged with the frozen ones)
                if d and d != "/":
                    mount, rel = self.plan.layer_of(d)
                    upper = uppers[mount]
                    self.plan.add_dirs(uppers, self.uid, self.gid, [os.path.dirname(d)])
                    path = os.path.join(upper, rel.lstrip("/"))
                    if not os.path.isdir(path):
                        os.mkdir(path, 0o755)
                        os.chown(path, self.uid, self.gid)
                        if ws_from and d == self.dirs[0] and ws_from != d:
                            # The slot's workspace shows the snapshot's (another slot's path):
                            # an overlay redirect, followed through the frozen layers.
                            os.setxattr(path, "trusted.overlay.redirect", os.fsencode(ws_from))
            return self._mount(layer, per_mount, "redirect_dir=follow")
        except OSError:
            _unmount_layer(layer)
            _release_disk(self.disks, layer)
            raise

    def _root_view(self, i):
        """Mount ``i``'s root as a read-only overlay of its idmapped lower (made once).

        The frozen layers must be direct lowers of a fork's overlay (so that their
        whiteouts and opaque directories count: an overlay in between would consume
        them), but overlayfs refuses a lower inside another lower's tree (ELOOP,
        overlapping layers), and the frozen layers are inside the root's. This view is
        another file system (an overlay of its own), so they no longer are. Its second
        lower is an empty tmpfs (a read-only overlay needs two; one inside ``/`` would
        overlap too).
        """
        with self._lower_lock:
            if i in self._views:
                return self._views[i]
            empty = os.path.join(self.lower, "empty")
            if empty not in self._view_mounts:
                os.makedirs(empty, mode=0o755, exist_ok=True)
                mount_tmpfs(empty, "size=4k,mode=755", MS_RDONLY)
                self._view_mounts.append(empty)
            view = os.path.join(self.lower, "view-%d" % i)
            os.makedirs(view, mode=0o700, exist_ok=True)
            mount_overlay_readonly("%s:%s" % (self._lowers[i], empty), view)
            self._view_mounts.append(view)
            self._views[i] = view
            return view

    def _ns_for(self, owner):
        with self._ns_lock:
            fd = self._userns.get(owner)
            if fd is None:
                fd = self._userns[owner] = userns_fd(self.uid, self.gid, inside=owner)
            return fd

    def install(self, layer):
        """Use ``layer`` from now on; return the layer it replaces (or None) for
        :meth:`retire`. The slot's processes must be gone."""
        with self._lock:
            old, self.active = self.active, layer
            return old

    def keep_standby(self, layer):
        """Keep an unused ``layer`` as the standby one if there is none; True if kept."""
        with self._lock:
            if self.standby is None:
                self.standby = layer
                return True
        return False

    def freeze(self):
        """Stop using the active layer and unmount it, keeping its files; return it.

        The slot's processes must be gone (a running process would keep the upper in use
        through its own mount namespace: an overlay's upper must not change while it is
        mounted). The layer's directory is the frozen state: never written again.
        """
        with self._lock:
            layer, self.active = self.active, None
        if layer is None:
            raise OSError(errno.ENOENT, "the slot has no layer in use to freeze")
        _unmount_layer(layer)
        if layer.disk is not None:  # kept mounted at its directory while the snapshot is
            self.disks.attach_at(layer.disk, layer.dir)
            layer.disk, layer._dirs = None, {}
        return layer

    def point_current(self):
        """Update ``base/current`` (for people and tests: where the slot's files are) to
        the layer in use. Thread-safe (a start's worker thread and the layers thread both
        point it)."""
        with self._current_lock:
            active = self.active
            if active is None:
                return
            link = os.path.join(self.base, "current")
            tmp = link + ".new"
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            os.symlink(os.path.basename(active.dir), tmp)
            os.rename(tmp, link)

    def teardown(self):
        """Unmount everything of this slot (the agent is stopping)."""
        with self._lock:
            for layer in (self.active, self.standby):
                if layer is not None:
                    _unmount_layer(layer)
                    _release_disk(self.disks, layer)
            self.active = self.standby = None
            for target in reversed(self._view_mounts):
                umount(target)
            self._view_mounts, self._views = [], {}
            for target in reversed(self._tpl_mounts):
                umount(target)
            self._tpl_mounts = []
            for target in reversed(self._lowers):
                umount(target)
            self._lowers = []
            for fd in self._userns.values():
                os.close(fd)
            self._userns = {}


def _release_disk(disks, layer):
    if layer.disk is not None:
        disks.release(layer.disk)
        layer.disk = None


def _unmount_layer(layer):
    for target in reversed(layer.mounted):
        umount(target)
    layer.mounted = []
    for target in reversed(layer.lower_mounts):
        umount(target)
    layer.lower_mounts = []
