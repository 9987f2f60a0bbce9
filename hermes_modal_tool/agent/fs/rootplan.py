"""What every fresh writable layer of a slot's root holds (see :mod:`.rootfs`).

Stdlib-only, Python 3.8. Computed once per sandbox (:class:`UpperPlan`), applied to each
new layer: directories a slot sees empty (``/root``, ``/tmp`` ...), whiteouts hiding what
a slot must not see (the agent's state, secrets, root-only host files, non-standard
top-level directories of the host), apt's setting for a one-uid namespace, and the
PEP 668 marker removed so ``pip`` installs into the system site-packages as in a
container image.
"""

import errno
import os
import stat
import threading

OPAQUE = "trusted.overlay.opaque"
#: Directories a slot sees empty (its own, writable): a container's fresh ones.
EMPTY_DIRS = {"/root": 0o700, "/home": 0o755, "/tmp": 0o1777, "/run": 0o755, "/mnt": 0o755,
              "/media": 0o755, "/lost+found": 0o700, "/var/tmp": 0o1777}
EMPTY_TOP = {p[1:] for p in EMPTY_DIRS if p.count("/") == 1}
#: Top-level names of a Linux root filesystem; anything else at the top of the host's root
#: (project checkouts, data) is hidden from slots.
STANDARD_TOP = frozenset(("bin", "boot", "dev", "etc", "lib", "lib32", "lib64", "libx32", "opt",
                          "proc", "sbin", "srv", "sys", "usr", "var")) | set(EMPTY_TOP)
APT_CONF = ("etc/apt/apt.conf.d/00hermes-modal-tool",
            b'// The slot is one uid: apt cannot drop privileges to _apt.\n'
            b'APT::Sandbox::User "root";\n')


#: Where a slot on an image without bash finds the host's static bash (bound read-only).
IMAGE_BASH = "/run/hmt-bash"


def shell_argv(image_bash):
    """``(bwrap arguments, shell argv)`` of a slot's bash: the image's own (``bash`` on its
    PATH), or the host's static bash ``image_bash`` bound in at :data:`IMAGE_BASH`."""
    if not image_bash:
        return [], ["bash", "--noprofile", "--norc"]
    return ["--ro-bind", image_bash, IMAGE_BASH], [IMAGE_BASH, "--noprofile", "--norc"]


def under_empty_dir(path):
    """Whether ``path`` (absolute, normalised) is one of :data:`EMPTY_DIRS` or below one:
    a slot sees that directory empty, so nothing in it needs hiding."""
    return any(path == d or path.startswith(d + "/") for d in EMPTY_DIRS)


def hidden_paths(hide, masked, nonstandard_top=True):
    """The paths each upper whites out: agent state and secrets under a visible top-level
    directory, root-only host files (``masked``) and, when the root is the host's
    (``nonstandard_top``), top-level entries that are not part of a Linux root."""
    out = set()
    for name in os.listdir("/") if nonstandard_top else ():
        if name not in STANDARD_TOP:
            out.add("/" + name)
    for path in list(hide) + list(masked):
        path = os.path.normpath(path)
        if path != "/" and not under_empty_dir(path) and os.path.lexists(path):
            out.add(path)
    # A path below a hidden one needs no whiteout of its own.
    return sorted(p for p in out if not any(p.startswith(q + "/") for q in out if q != p))


def pep668_markers():
    """The ``EXTERNALLY-MANAGED`` files of the root's Pythons (a slot's pip may install)."""
    found = []
    for base in ("/usr/lib", "/usr/local/lib"):
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            if name.startswith("python3"):
                path = "%s/%s/EXTERNALLY-MANAGED" % (base, name)
                if os.path.lexists(path):
                    found.append(path)
    return found


def separate_mounts(visible):
    """Top-level directories of ``/`` that are mount points of their own (in a container:
    ``/usr``, ``/etc`` ... bound in one by one). An overlay's lower layer never shows what
    is mounted below it, so each gets an overlay of its own. ``visible(name)`` filters."""
    found = []
    try:
        with open("/proc/self/mountinfo") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        name = point[1:]
        if point.count("/") == 1 and name and visible(name) and os.path.isdir(point) \
                and not os.path.islink(point) and point not in found:
            found.append(point)
    return sorted(found)


class UpperPlan:
    """What every fresh writable layer of a sandbox holds (computed once, applied per tenant).

    ``mounts`` are the layer roots: ``/`` and each separately mounted top-level directory
    (see :func:`separate_mounts`); every entry goes into the layer it falls in.
    """

    def __init__(self, hide, masked, nonstandard_top=True, image_root=None):
        #: The lower's host path ("" for the host's root); an image is used as it is: none
        #: of the host's hiding applies to it (see :meth:`for_image`).
        self.root = image_root or ""
        self._ops = None  # template_ops, made on first use
        self._dir_ops = {}  # dir_ops by list of directories
        if image_root:
            self.whiteouts, self.empty, self.mounts = [], [], ["/"]
            return
        self.whiteouts = hidden_paths(hide, masked, nonstandard_top) + pep668_markers()
        self.empty = sorted((p, m) for p, m in EMPTY_DIRS.items() if os.path.isdir(p))
        hidden = set(self.whiteouts)
        skip = set(EMPTY_TOP) | {"proc", "sys", "dev"}
        self.mounts = ["/"] + separate_mounts(
            lambda name: name not in skip and "/" + name not in hidden)

    @classmethod
    def for_image(cls, image_root):
        """The plan for slots on an unpacked image at ``image_root``: the image as it is
        (its own ``/root``, ``/tmp``, no host files to hide), plus apt's one-uid setting
        and the workspace and working directories."""
        return cls((), (), False, image_root)

    def source_of(self, mount):
        """The host path of layer root ``mount`` (what its idmapped lower clones)."""
        return self.root + mount if self.root else mount

    def layer_of(self, path):
        """``(mount, path relative to it)`` for an absolute path of the slot's view."""
        best = "/"
        for mount in self.mounts:
            if mount != "/" and (path == mount or path.startswith(mount + "/")):
                best = mount
        return best, path[len(best):] if best != "/" else path

    def own_upper(self, upper, mount, uid, gid):
        """Give layer root ``upper`` (of ``mount``) the slot's owner and the root's mode."""
        os.chown(upper, uid, gid)
        os.chmod(upper, self._top_mode(mount))

    def _top_mode(self, mount):
        """The mode of layer root ``mount`` in a slot's layers: 0755 for ``/``, else the
        root's own."""
        return 0o755 if mount == "/" else stat.S_IMODE(os.stat(self.source_of(mount)).st_mode)

    def apply(self, uppers, uid, gid, dirs=()):
        """Fill the new, empty layers ``uppers`` (mount -> directory: a slot's template, see
        :mod:`.rootfs`) as the agent (real root); ``dirs`` (absolute, in the slot's view) are
        created when the root does not have them.

        The entries every slot gets (emptied directories, whiteouts, apt's setting, their
        parents) are worked out once (:meth:`template_ops`) and replayed here with the
        slot's ids: a few system calls per entry, no look at the lower (which took about
        1.6 ms of CPU per slot, most of a fresh slot's root).
        """
        for mount, upper in uppers.items():
            self.own_upper(upper, mount, uid, gid)
        for kind, mount, rel, mode, owner, group in self.template_ops():
            path = uppers[mount] + rel
            if kind == "whiteout":
                os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))
            elif kind == "file":
                with open(path, "wb") as fh:
                    fh.write(mode)  # the file's text
                os.chown(path, uid, gid)
            else:  # a directory: a parent with the lower's mode, or an emptied one
                _make_dir(path, mode, owner, group, uid, gid)
                if kind == "empty":
                    os.setxattr(path, OPAQUE, b"y")
        self.add_dirs(uppers, uid, gid, dirs)

    def template_tops(self, path):
        """The layer roots of a template in ``path``: ``path/N`` for the plan's mount N."""
        return [os.path.join(path, str(i)) for i in range(len(self.mounts))]

    def make_template(self, path, uid, gid, dirs=()):
        """Make a template layer in the new directory ``path`` (mode 0700): a layer root per
        mount (:meth:`template_tops`, mode 0755) filled by :meth:`apply`; returns them."""
        os.mkdir(path, 0o700)
        tops = self.template_tops(path)
        for top in tops:
            os.mkdir(top, 0o755)
        self.apply({m: tops[i] for i, m in enumerate(self.mounts)}, uid, gid, dirs)
        return tops

    def add_dirs(self, uppers, uid, gid, dirs):
        """Make directories ``dirs`` (absolute, in the slot's view) and their missing
        parents in layers ``uppers`` (mount -> directory), with the root's modes and owners
        where it has them, else mode 0755 and the slot's ids (:meth:`dir_ops`); one that
        is there already is kept as it is. Raises OSError as :meth:`_lower_dir` does, or
        ``EEXIST`` where something other than a directory is in the way."""
        mask = _umask()
        for mount, rel, mode, owner, group, fix in self.dir_ops(dirs):
            path = uppers[mount] + rel
            try:
                os.mkdir(path, mode)
            except FileExistsError:
                if not os.path.isdir(path):
                    raise
                continue
            os.chown(path, uid if owner == 0 else owner, gid if group == 0 else group)
            if fix or mode & mask:  # else mkdir gave the mode already
                os.chmod(path, mode)

    def dir_ops(self, dirs):
        """The directories :meth:`add_dirs` makes for ``dirs`` in empty layers, parents
        first, as ``(mount, rel, mode, owner, group, fix)`` (``rel`` below the layer root of
        ``mount``, with a leading "/"; owner and group 0 stand for the slot's ids; ``fix``:
        ``mkdir`` alone cannot give the mode, which has set-id or sticky bits or sits in a
        set-group-id parent). Worked out once per list (a look at the root for each
        directory), so that each new layer of a slot costs only its ``mkdir``, ``chown``
        and, where needed, ``chmod``. Thread-safe (the same list either way). Raises
        OSError as :meth:`_lower_dir` does."""
        key = tuple(d for d in dirs if d and d != "/")
        ops = self._dir_ops.get(key)
        if ops is not None:
            return ops
        ops, modes = [], {}
        for d in key:
            mount, rel = self.layer_of(d)
            parent_mode = self._top_mode(mount)
            cur = ""
            for part in [p for p in rel.split("/") if p]:
                cur += "/" + part
                if (mount, cur) not in modes:
                    try:
                        mode, owner, group = self._lower_dir(mount.rstrip("/") + cur)
                    except FileNotFoundError:  # not in the root (nor below it): the slot's own
                        mode, owner, group = 0o755, 0, 0
                    fix = bool(mode & ~0o777 or parent_mode & stat.S_ISGID)
                    ops.append((mount, cur, mode, owner, group, fix))
                    modes[(mount, cur)] = mode
                parent_mode = modes[(mount, cur)]
        self._dir_ops[key] = ops
        return ops

    def template_ops(self):
        """What :meth:`apply` makes before the slot's own directories, in order, as
        ``(kind, mount, rel, mode, owner, group)`` (``rel``: below the layer root of
        ``mount``, with a leading "/"): ``dir`` a parent directory with the lower's mode and
        owner (0 stands for the slot's ids), ``empty`` an emptied directory (opaque, the
        slot's), ``whiteout``, ``file`` (``mode`` holds its text). Computed on first use
        (thread-safe: the same list either way). Raises OSError as :meth:`_lower_dir` does."""
        ops = self._ops
        if ops is not None:
            return ops
        ops, made = [], set()

        def parents(mount, rel_dir):
            cur = ""
            for part in [p for p in rel_dir.split("/") if p]:
                cur += "/" + part
                if (mount, cur) in made:
                    continue
                ops.append(("dir", mount, cur) + self._lower_dir(mount.rstrip("/") + cur))
                made.add((mount, cur))

        def entry(kind, path, mode=0):
            mount, rel = self.layer_of(path)
            parents(mount, os.path.dirname(rel))
            ops.append((kind, mount, rel, mode, 0, 0))
            made.add((mount, rel))

        for name, mode in self.empty:
            entry("empty", name, mode)
        for name in self.whiteouts:
            entry("whiteout", name)
        conf, text = APT_CONF
        if os.path.isdir(self.root + "/etc/apt/apt.conf.d"):
            entry("file", "/" + conf, text)
        self._ops = ops
        return ops

    def _lower_dir(self, lower):
        """``(mode, owner, group)`` of directory ``lower`` (a path of the slot's view) in
        the root. Raises FileNotFoundError where the slot sees none (below an emptied
        directory too), OSError ``ENOTDIR`` where it is not a directory."""
        if not self.root and under_empty_dir(lower):
            lower = "/nonexistent-in-the-slot"  # below an emptied directory
        lower = self.source_of(lower)
        st = os.lstat(lower)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, "not a directory in the root", lower)
        return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


class SharedTemplate:
    """The template layer every slot of a sandbox shares: the plan's entries
    (:meth:`UpperPlan.apply`) and the directories all slots have (``dirs``: the workspaces'
    parent, the working and control directories), made once, owned by root, in ``path``
    (on the sandbox's tmpfs).

    Each slot sees it through an idmapped mount of its own that shows root's files as the
    slot's (:meth:`.rootfs.SlotRoot`, the user namespace its root's lower is mapped with):
    three system calls per slot instead of ~150 (``mkdir``/``mknod``/``chown``/``chmod``
    for each of ~40 entries: 1.6 s of the agents' 5 s of spawn-thread CPU over 1,000
    fresh slots, ``cProfile`` with ``time.thread_time``). Directories of one slot only
    (its workspace) go into each of its layers instead.

    Where an entry is owned by another id than root's (a parent directory copied from the
    root with its group, say), which the one-id mapping cannot show as it is on disk,
    ``broken`` says so and slots make their own templates, as before.
    Thread-safe."""

    def __init__(self, path, plan, dirs):
        self.path = path
        self.plan = plan
        self.dirs = [d for d in dirs if d and d != "/"]
        self.broken = None  # why slots make their own templates instead, or None
        self._tops = None
        self._lock = threading.Lock()

    def tops(self):
        """The template's layer roots, one per plan mount, in the plan's order: made on the
        first call. Raises OSError (``broken`` says why) when it cannot be made or used."""
        with self._lock:
            if self.broken is not None:
                raise OSError(errno.EINVAL, self.broken)
            if self._tops is None:
                try:
                    self._tops = self._make()
                except OSError as exc:
                    self.broken = "the shared template could not be made: %s" % (exc,)
                    raise
            return self._tops

    def refuse(self, why):
        """Stop using the template (an idmapped mount of it failed: ``why``)."""
        with self._lock:
            self.broken = "%s" % (why,)

    def _make(self):
        tops = self.plan.make_template(self.path, 0, 0, self.dirs)
        for top in tops:  # the template's own: nothing of a slot is in it
            for where, dirs, files in os.walk(top):
                for name in [""] + dirs + files:
                    st = os.lstat(os.path.join(where, name))
                    if st.st_uid or st.st_gid:
                        raise OSError(errno.EINVAL, "%s is owned by %d:%d, not root" % (
                            os.path.join(where, name), st.st_uid, st.st_gid))
        return tops


def _make_dir(path, mode, owner, group, uid, gid):
    """``mkdir`` with ``mode``, owned by ``owner``/``group``, 0 standing for the slot's
    ``uid``/``gid`` (the root's owner is the slot's root)."""
    os.mkdir(path)
    os.chown(path, uid if owner == 0 else owner, gid if group == 0 else group)
    os.chmod(path, mode)


_UMASK = []


def _umask():
    """The process's umask (``Umask:`` in ``/proc/self/status``, read once: the agent
    sets it at its start); 0o777 where it cannot be read, so that every mode is set by
    ``chmod``."""
    if not _UMASK:
        mask = 0o777
        try:
            with open("/proc/self/status") as fh:
                for line in fh:
                    if line.startswith("Umask:"):
                        mask = int(line.split()[1], 8)
        except (OSError, ValueError, IndexError):
            pass
        _UMASK.append(mask)
    return _UMASK[0]
