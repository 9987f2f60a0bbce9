"""Where a sandbox's cgroup v2 tree goes, and the agent's move out of its way.

Stdlib-only, Python 3.8.

cgroup v2's "no internal processes" rule: a cgroup that hands the memory, pids or cpu
controller to its children holds no process itself (the hierarchy's root excepted), and
the kernel refuses ``cgroup.subtree_control`` with ``EBUSY`` otherwise. So, as systemd
and container runtimes do, the agent first moves itself (and its children, the spawner)
into a leaf of its own, then enables the controllers down to the slots::

    <parent>/hermes-modal-tool/<sandbox>/agent          the agent, its spawner (no limits)
    <parent>/hermes-modal-tool/<sandbox>/slots          the sandbox's limits
    <parent>/hermes-modal-tool/<sandbox>/slots/slot_N   one slot's limits

``<parent>`` is, in this order:

- the agent's own cgroup, when nothing but the agent and its children is in it and the
  agent may write its ``cgroup.procs`` and ``cgroup.subtree_control``: a cgroup
  delegated to it (``systemd-run --user --scope -p Delegate=yes``, a unit with
  ``Delegate=yes``, the root of a container's own cgroup namespace);
- else, when the agent is root, the hierarchy's root (``/sys/fs/cgroup``), which the
  rule exempts (what container runtimes' cgroupfs drivers use);
- else none: :func:`place` raises and the caller falls back to rlimits, with the reason.

The agent's leaf and ``<sandbox>`` stay until the agent has exited (a process cannot
remove the cgroup it is in): the local driver removes them then, or systemd with the
delegated scope.
"""

import errno
import os

from ..fs.mounts import write_control

#: Controllers a slot's limits need; ``cpu`` (its share and cap) is used when delegated.
REQUIRED = ("memory", "pids")
WANTED = ("memory", "pids", "cpu")
TOP = "hermes-modal-tool"


class Placement:
    """Where one sandbox's cgroup v2 tree is (absolute paths) and how it was chosen.

    Attributes: ``sandbox`` (``.../hermes-modal-tool/<sandbox>``), ``agent`` (the agent's
    leaf), ``slots`` (the sandbox's limits; slot cgroups below), ``controllers`` (those
    enabled, a subset of :data:`WANTED`), ``how`` (for status: ``"delegated: ..."`` or
    ``"root: ..."``).
    """

    def __init__(self, parent, name, controllers, how):
        self.parent = parent
        self.top = os.path.join(parent, TOP)
        self.sandbox = os.path.join(self.top, name)
        self.agent = os.path.join(self.sandbox, "agent")
        self.slots = os.path.join(self.sandbox, "slots")
        self.controllers = controllers
        self.how = how


def place(mount, name, pid=None):
    """Make the sandbox ``name``'s cgroup v2 tree under the cgroup2 ``mount`` and move the
    agent (``pid``, default this process) and its children there; return a
    :class:`Placement`.

    Raises OSError with a reason fit for status (``limits_note``) where it cannot: no
    cgroup the agent may manage, a missing controller, or a parent that holds other
    processes (``EBUSY``).
    """
    pid = os.getpid() if pid is None else pid
    own = own_path(pid)
    own_dir = os.path.join(mount, own.lstrip("/"))
    others = foreign_procs(own_dir, pid)
    if not others and _may_manage(own_dir):
        parent = own_dir
        how = "delegated: the agent's own cgroup %s (nothing else runs in it)" % own
    elif os.geteuid() == 0:
        parent = mount
        how = "root: under the hierarchy's root %s" % mount
    else:
        raise OSError(errno.EACCES, (
            "cgroup v2: the agent (uid %d) may not manage its cgroup %s (%s); start it in a "
            "delegated cgroup: systemd-run --user --scope -p Delegate=yes"
            % (os.geteuid(), own, "other processes are in it" if others else "not writable")))
    available = _read(os.path.join(parent, "cgroup.controllers")).split()
    missing = [c for c in REQUIRED if c not in available]
    if missing:
        raise OSError(errno.ENOENT, "cgroup v2: %s does not offer the %s controller%s" % (
            parent, " and ".join(missing), "s" if len(missing) > 1 else ""))
    controllers = tuple(c for c in WANTED if c in available)
    p = Placement(parent, name, controllers, how)
    for d in (p.top, p.sandbox, p.agent):
        _mkdir(d)
    # First out of the way: nothing may stay in a cgroup that hands controllers down.
    moved = [pid] + [c for c in _procs(own_dir) if c != pid and _parent_of(c) == pid]
    try:
        for member in moved:
            write_control(os.path.join(p.agent, "cgroup.procs"), str(member).encode())
        enable = " ".join("+" + c for c in controllers).encode()
        for d in (parent, p.top, p.sandbox):
            try:
                write_control(os.path.join(d, "cgroup.subtree_control"), enable)
            except OSError as exc:
                if exc.errno == errno.EBUSY:
                    raise OSError(errno.EBUSY, (
                        "cgroup v2: %s holds processes, so it cannot hand controllers to "
                        "children (the no-internal-processes rule)" % d)) from exc
                raise
        _mkdir(p.slots)
        write_control(os.path.join(p.slots, "cgroup.subtree_control"), enable)
    except OSError:
        for member in moved:  # back where they were, and nothing left behind
            try:
                write_control(os.path.join(own_dir, "cgroup.procs"), str(member).encode())
            except OSError:
                pass
        for d in (p.slots, p.agent, p.sandbox, p.top):
            _rmdir(d)
        raise
    return p


def own_path(pid=None):
    """The cgroup v2 path of ``pid`` (``0::/...`` in ``/proc/<pid>/cgroup``), ``/`` if none."""
    with open("/proc/%s/cgroup" % ("self" if pid is None else pid)) as fh:
        for line in fh:
            hid, _, path = line.rstrip("\n").split(":", 2)
            if hid == "0":
                return path
    return "/"


def foreign_procs(cgroup_dir, pid):
    """Pids in ``cgroup_dir`` other than ``pid`` and its children."""
    return [p for p in _procs(cgroup_dir) if p != pid and _parent_of(p) != pid]


def remove_tree(sandbox_dir):
    """Kill what is left in a sandbox's cgroup v2 tree (``cgroup.kill``) and remove it,
    deepest first; return True when ``sandbox_dir`` is gone. For the driver, after the
    agent exited."""
    if not os.path.isdir(sandbox_dir):
        return True
    for top, _, _ in os.walk(sandbox_dir, topdown=False):  # deepest first, itself last
        _kill_and_rmdir(top)
    _rmdir(os.path.dirname(sandbox_dir))  # hermes-modal-tool, once no sandbox uses it
    return not os.path.isdir(sandbox_dir)


def kill(cgroup_dir):
    """SIGKILL every process in ``cgroup_dir`` and below at once (``cgroup.kill``, Linux
    5.14+); False where the kernel has no such file."""
    try:
        write_control(os.path.join(cgroup_dir, "cgroup.kill"), b"1")
        return True
    except OSError as exc:
        if exc.errno == errno.ENOENT and os.path.isdir(cgroup_dir):
            return False
        return exc.errno == errno.ENOENT  # the cgroup is gone: nothing left to kill


def _kill_and_rmdir(d):
    kill(d)
    _rmdir(d)


def _may_manage(d):
    return all(os.access(os.path.join(d, f), os.W_OK)
               for f in ("cgroup.procs", "cgroup.subtree_control"))


def _procs(d):
    try:
        return [int(x) for x in _read(os.path.join(d, "cgroup.procs")).split()]
    except (OSError, ValueError):
        return []


def _parent_of(pid):
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _read(path):
    with open(path) as fh:
        return fh.read()


def _mkdir(path):
    try:
        os.mkdir(path)
    except FileExistsError:
        pass


def _rmdir(path):
    try:
        os.rmdir(path)
    except OSError:
        pass
