"""Per-sandbox and per-slot cgroups (v1 or v2): memory, pids and CPU limits, and the
kill switch for everything a slot started. Falls back to rlimits (``mode == "rlimit"``)
where the machine refuses.

Per slot, cgroup v1: ``memory.limit_in_bytes``, ``pids.max`` (and the sandbox's CPU
quota above). cgroup v2 (where the tree goes: :mod:`.cgroupv2`): ``memory.max`` with
``memory.swap.max`` 0 and ``memory.oom.group`` 1 (an OOM kill takes the whole slot),
``pids.max``, ``cpu.weight`` (equal shares) and ``cpu.max`` where the limits have a
``slot_cpu``; the sandbox's ``memory.max``, ``pids.max`` and ``cpu.max`` on the ``slots``
cgroup above them; the kill through ``cgroup.kill``.

Stdlib-only, Python 3.8.
"""

import errno
import os
import signal

from ..fs.mounts import write_control
from . import cgroupv2
from .isolation import _kill


class Cgroups:
    """Per-sandbox and per-slot cgroups (v1 or v2), or None when the machine refuses.

    ``mode`` is ``"cgroup-v2"``, ``"cgroup-v1"`` or ``"rlimit"`` (the fallback);
    ``reason`` says why the fallback, or with cgroup v2 where the tree is
    (:mod:`.cgroupv2`: a delegated cgroup, or under the hierarchy's root as root).
    """

    CONTROLLERS = ("memory", "pids", "cpu")
    #: v1 controllers used where mounted (for the usage ledger: ``agent/limits/usage.py``);
    #: one mounted together with a required one (``cpu,cpuacct``) shares its directory.
    OPTIONAL = ("cpuacct",)

    def __init__(self, name, limits):
        self.name = name
        self.limits = limits
        self.mode = "rlimit"
        self.reason = ""
        self._bases = {}  # controller -> sandbox cgroup dir
        self._made = set()  # slots whose cgroups exist with their limits
        self.placement = None  # cgroup v2: where its tree is (cgroupv2.Placement)
        try:
            self._setup()
        except OSError as exc:
            self.reason = "cgroups unavailable (%s); using rlimits" % (exc.strerror or exc,)
            self.remove_all()
            self._bases = {}
            self.mode = "rlimit"

    # -- setup -------------------------------------------------------------
    def _setup(self):
        mounts = _cgroup_mounts()
        if "cgroup2" in mounts and not mounts.get("v1"):
            self.placement = cgroupv2.place(mounts["cgroup2"], self.name)
            self._bases = {"unified": self.placement.slots}
            self.mode = "cgroup-v2"
            self.reason = self.placement.how
        else:
            v1 = mounts.get("v1", {})
            for ctrl in self.CONTROLLERS:
                if ctrl not in v1:
                    raise OSError(errno.ENOENT, "no cgroup v1 %s controller mounted" % ctrl)
            for ctrl in self.CONTROLLERS:
                base = os.path.join(v1[ctrl], "hermes-modal-tool", self.name)
                _mkdir(base)
                self._bases[ctrl] = base
            for ctrl in self.OPTIONAL:
                mnt = v1.get(ctrl)
                if mnt is None or mnt in (v1[c] for c in self.CONTROLLERS):
                    continue  # absent, or the same directory as a required controller's
                base = os.path.join(mnt, "hermes-modal-tool", self.name)
                try:
                    _mkdir(base)
                except OSError:
                    continue  # only the usage ledger needs it: it says what it lacks
                self._bases[ctrl] = base
            self.mode = "cgroup-v1"
        self._apply(self._dirs(None), sandbox=True)

    def _dirs(self, slot):
        sub = "" if slot is None else "slot_%d" % slot
        return {ctrl: os.path.join(base, sub) if sub else base for ctrl, base in self._bases.items()}

    def _apply(self, dirs, sandbox):
        lim = self.limits
        mem = lim.get("memory_mb") if sandbox else lim.get("slot_memory_mb")
        pids = lim.get("sandbox_pids") if sandbox else lim.get("pids")
        cpu = lim.get("cpu") if sandbox else None
        if self.mode == "cgroup-v2":
            d = dirs["unified"]
            has_cpu = "cpu" in self.placement.controllers
            if mem:
                _write(os.path.join(d, "memory.max"), str(int(mem) * 1024 * 1024))
                _write(os.path.join(d, "memory.swap.max"), "0", ignore=(errno.ENOENT,))
            if not sandbox:  # an OOM kill takes the slot's whole cgroup, never half of it
                _write(os.path.join(d, "memory.oom.group"), "1", ignore=(errno.ENOENT,))
            if pids:
                _write(os.path.join(d, "pids.max"), str(int(pids)))
            if has_cpu and not sandbox:  # equal shares of the sandbox's CPU between slots
                _write(os.path.join(d, "cpu.weight"), "100")
                cpu = lim.get("slot_cpu")
            if has_cpu and cpu:
                _write(os.path.join(d, "cpu.max"), "%d 100000" % max(1000, int(cpu * 100000)))
        else:
            if mem:
                _write(os.path.join(dirs["memory"], "memory.limit_in_bytes"),
                       str(int(mem) * 1024 * 1024))
            if pids:
                _write(os.path.join(dirs["pids"], "pids.max"), str(int(pids)))
            if cpu:
                _write(os.path.join(dirs["cpu"], "cpu.cfs_period_us"), "100000")
                _write(os.path.join(dirs["cpu"], "cpu.cfs_quota_us"),
                       str(max(1000, int(cpu * 100000))))

    # -- per slot ----------------------------------------------------------
    def slot_procs_files(self, slot, name="cgroup.procs"):
        """Create the slot's cgroups; return the files to join them by (``name``:
        ``cgroup.procs``, or in v1 ``tasks``, which moves one thread)."""
        if self.mode == "rlimit":
            return []
        dirs = self._dirs(slot)
        if slot not in self._made or not os.path.isdir(next(iter(dirs.values()))):
            for d in dirs.values():  # once per slot (every shell start used to rewrite them)
                _mkdir(d)
            self._apply(dirs, sandbox=False)
            self._made.add(slot)
        return [os.path.join(d, name) for d in dirs.values()]

    def v1_controllers(self):
        """The v1 controllers whose cgroups the slots join (none on v2 or without cgroups)."""
        return [] if self.mode != "cgroup-v1" else list(self._bases)

    def sandbox_files(self, name):
        """The sandbox's own cgroups' files called ``name`` (``tasks``, say)."""
        return [os.path.join(d, name) for d in self._dirs(None).values()]

    def slot_pids(self, slot, one=False):
        """Host pids currently in the slot's cgroup (empty when not using cgroups), never
        the agent's own (a thread of it is there while it starts a shell: threadstart.py).
        ``one``: read one controller's list (they hold the same processes, but for a
        moment at a start), not all of them."""
        if self.mode == "rlimit":
            return []
        pids = set()
        dirs = self._dirs(slot)
        for d in [next(iter(dirs.values()))] if one else dirs.values():
            try:
                with open(os.path.join(d, "cgroup.procs")) as fh:
                    pids.update(int(x) for x in fh.read().split())
            except OSError:
                pass
        pids.discard(os.getpid())
        return sorted(pids)

    def kill_slot(self, slot, spare=None, one=False):
        """SIGKILL every process in the slot's cgroup but ``spare`` (a pid); ``one``: as
        listed by one controller (see :meth:`slot_pids`). cgroup v2 without ``spare``:
        all at once through ``cgroup.kill`` (no fork can slip past a list read first)."""
        if self.mode == "cgroup-v2" and spare is None and cgroupv2.kill(self._dirs(slot)["unified"]):
            return
        for pid in self.slot_pids(slot, one):
            if pid != spare:
                _kill(pid, signal.SIGKILL)

    def remove_slot(self, slot):
        self._made.discard(slot)
        for d in self._dirs(slot).values():
            _rmdir(d)

    def remove_all(self):
        """Remove the sandbox's cgroups; return True when none is left (with cgroup v2,
        none but the agent's own leaf and its parent, which the driver removes once the
        agent has exited: :func:`.cgroupv2.remove_tree`)."""
        for base in self._bases.values():
            if os.path.isdir(base):
                for entry in os.listdir(base):
                    if entry.startswith("slot_"):
                        _rmdir(os.path.join(base, entry))
            _rmdir(base)
            if self.mode != "cgroup-v2":
                _rmdir(os.path.dirname(base))  # the shared parent, once no sandbox uses it
        return not any(os.path.isdir(base) for base in self._bases.values())

    def pids_events_file(self, slot):
        """The slot's ``pids.events`` file (None without cgroups)."""
        d = {} if self.mode == "rlimit" else self._dirs(slot)
        return os.path.join(d.get("pids") or d["unified"], "pids.events") if d else None

    def pids_limit_events(self, slot):
        """How many times a fork in the slot failed at its pids limit (``pids.events`` ``max``)."""
        path = self.pids_events_file(slot)
        if path is None:
            return 0
        try:
            with open(path) as fh:
                for line in fh:
                    key, _, value = line.partition(" ")
                    if key == "max":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def slot_file(self, slot, ctrl, name):
        """The path of the slot's cgroup file ``name`` of v1 controller ``ctrl`` (on v2 the
        unified directory's, whatever ``ctrl``); None without that controller. A v1
        controller mounted together with another (``cpu,cpuacct``) is found under it."""
        if self.mode == "rlimit":
            return None
        dirs = self._dirs(slot)
        if self.mode == "cgroup-v2":
            return os.path.join(dirs["unified"], name)
        d = dirs.get(ctrl)
        if d is None and ctrl == "cpuacct":
            d = dirs.get("cpu")  # co-mounted: its files are in the cpu directory
        return None if d is None else os.path.join(d, name)

    def memory_peak_exceeded(self, slot):
        """True if the slot's memory cgroup has hit its limit (an OOM kill is likely)."""
        if self.mode == "cgroup-v1":
            path = os.path.join(self._dirs(slot)["memory"], "memory.failcnt")
        elif self.mode == "cgroup-v2":
            path = os.path.join(self._dirs(slot)["unified"], "memory.events")
        else:
            return False
        try:
            with open(path) as fh:
                text = fh.read()
        except OSError:
            return False
        if self.mode == "cgroup-v1":
            return text.strip() not in ("", "0")
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key in ("oom_kill", "oom_group_kill") and value.strip() != "0":
                return True
        return False


def _cgroup_mounts():
    found = {"v1": {}}
    with open("/proc/self/mounts") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) < 4:
                continue
            mnt, fstype, opts = parts[1], parts[2], parts[3].split(",")
            if fstype == "cgroup2":
                found["cgroup2"] = mnt
            elif fstype == "cgroup":
                for ctrl in Cgroups.CONTROLLERS + Cgroups.OPTIONAL:
                    if ctrl in opts and ctrl not in found["v1"]:
                        found["v1"][ctrl] = mnt
    return found


def _mkdir(path):
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    except FileNotFoundError:  # its parent too
        os.makedirs(path, exist_ok=True)


def _rmdir(path):
    try:
        os.rmdir(path)
    except OSError:
        pass


def _write(path, value, ignore=()):
    try:
        write_control(path, value.encode())
    except OSError as exc:
        if exc.errno not in ignore:
            raise
