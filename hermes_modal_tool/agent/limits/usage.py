"""What a slot's tenant (one trajectory) has used so far: the ``usage`` op.

Stdlib-only, Python 3.8. A tenant starts when its slot's reset ends (the old tenant's
processes are gone) and ends at the next reset; the host asks for ``usage`` before it
resets a released slot (``hermes_modal_tool/usage.py`` adds what the host counts).

Measured from the slot's cgroup where it has one: CPU from ``cpuacct.usage_user`` /
``cpuacct.usage_sys`` (v1, nanoseconds; ``cpuacct.stat`` in clock ticks where those are
missing) or ``cpu.stat`` ``user_usec`` / ``system_usec`` (v2), each less its value when
the tenant started; the memory peak from ``memory.max_usage_in_bytes`` (v1, reset to
the current use when the tenant starts) or ``memory.peak`` (v2: reset through a kept
descriptor where the kernel allows, 6.12 and later; else the peak since the slot's
cgroup was made, said in ``notes``). Without cgroups (``rlimit`` mode) CPU and memory
are None. The writable layer (or the workspace, for a slot without a layered root) is
measured in a worker thread, never on the event loop; its peak is the largest of that
and what :mod:`.diskwatch` saw while commands ran.
"""

import os
import stat

from ..fs.trees import walk_path


class TenantUsage:
    """The counters of one slot's current tenant (kept on its ``SlotRuntime``)."""

    __slots__ = ("cpu_base", "disk_peak", "peak_fd", "notes")

    def __init__(self):
        self.cpu_base = (0, 0)  # (user_ns, system_ns) when the tenant started
        self.disk_peak = 0
        self.peak_fd = None  # v2: memory.peak opened for a per-descriptor reset
        self.notes = []


def of(slot):
    """The slot's :class:`TenantUsage`, made on first use."""
    tu = getattr(slot, "tenant_usage", None)
    if tu is None:
        tu = slot.tenant_usage = TenantUsage()
    return tu


def _read(path):
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            return fh.read(4096).decode("ascii", "replace")
    except OSError:
        return None


def cpu_ns(agent, slot):
    """(user_ns, system_ns) the slot's cgroup has used since it was made; None without one."""
    cg = agent.cgroups
    if not cg or cg.mode == "rlimit":
        return None
    if cg.mode == "cgroup-v2":
        return _stat_pair(_read(cg.slot_file(slot.index, "cpu", "cpu.stat")),
                          "user_usec", "system_usec", 1000)
    user = _read(cg.slot_file(slot.index, "cpuacct", "cpuacct.usage_user"))
    system = _read(cg.slot_file(slot.index, "cpuacct", "cpuacct.usage_sys"))
    if user is not None and system is not None:
        try:
            return int(user), int(system)
        except ValueError:
            pass
    return _stat_pair(_read(cg.slot_file(slot.index, "cpuacct", "cpuacct.stat")),
                      "user", "system", 1e9 / os.sysconf("SC_CLK_TCK"))


def _stat_pair(text, user, system, scale):
    """``(user, system)`` from a cgroup stat file's ``key value`` lines, each times
    ``scale`` (to nanoseconds); None when the file or a key is missing."""
    if text is None:
        return None
    vals = dict(line.split(" ", 1) for line in text.splitlines() if " " in line)
    try:
        return int(int(vals[user]) * scale), int(int(vals[system]) * scale)
    except (KeyError, ValueError):
        return None


def memory_peak(agent, slot):
    """Peak memory (bytes) of the slot's cgroup in this tenant; None without one."""
    cg = agent.cgroups
    if not cg or cg.mode == "rlimit":
        return None
    if cg.mode == "cgroup-v1":
        text = _read(cg.slot_file(slot.index, "memory", "memory.max_usage_in_bytes"))
    else:
        fd = of(slot).peak_fd
        if fd is not None:
            try:
                text = os.pread(fd, 64, 0).decode("ascii", "replace")
            except OSError:
                text = None
        else:
            text = _read(cg.slot_file(slot.index, "memory", "memory.peak"))
    try:
        return int(text.strip()) if text else None
    except ValueError:
        return None


def new_tenant(agent, slot):
    """The slot's old tenant is gone (its processes killed): count from zero again."""
    tu = of(slot)
    tu.disk_peak = 0
    tu.notes = []
    tu.cpu_base = cpu_ns(agent, slot) or (0, 0)
    cg = agent.cgroups
    if not cg or cg.mode == "rlimit":
        return
    if cg.mode == "cgroup-v1":
        path = cg.slot_file(slot.index, "memory", "memory.max_usage_in_bytes")
        try:
            with open(path, "wb") as fh:
                fh.write(b"0")  # v1: sets the peak to the current use
        except (OSError, TypeError):
            tu.notes.append("memory peak not reset between tenants")
        return
    path = cg.slot_file(slot.index, "memory", "memory.peak")
    if tu.peak_fd is None:
        try:
            tu.peak_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except (OSError, TypeError):
            tu.peak_fd = None
    try:
        if tu.peak_fd is None:
            raise OSError("memory.peak not writable")
        os.write(tu.peak_fd, b"reset\n")  # 6.12+: the peak seen through this descriptor
    except OSError:
        tu.notes.append("memory peak is the slot's since its cgroup was made "
                        "(this kernel cannot reset memory.peak)")


def disk_seen(slot, used):
    """A measurement of the slot's writable layer (bytes) made elsewhere (diskwatch)."""
    tu = of(slot)
    if used > tu.disk_peak:
        tu.disk_peak = used


def layer_bytes(root):
    """Bytes the slot of ``root`` (a :class:`.rootfs.SlotRoot`) has written in its layer in
    use: its own file system's usage when it has one (deleted-but-open files count too:
    ``statvfs``, O(1)), else its blocks, walked (linear in its files) with directory
    descriptors (``trees.walk_tree``): the slot may change the layer meanwhile, and the
    walk never follows its links or leaves the layer; a directory moved during the walk
    ends it early (what was counted is returned)."""
    layer = root.active
    if layer is None:
        return 0
    if layer.disk is not None:
        return root.disks.used(layer.disk)[0]
    total = [0]

    def visit(fd, name, st):
        total[0] += st.st_blocks * 512
        return stat.S_ISDIR(st.st_mode)

    for sub in ("upper", "layers"):
        walk_path(os.path.join(layer.dir, sub), visit)
    return total[0]


def disk_bytes(slot):
    """Blocking: bytes the slot has written (its layer, or its workspace without one)."""
    if slot.root is not None:
        return layer_bytes(slot.root)
    total = [0]

    def visit(fd, name, st):
        total[0] += st.st_blocks * 512
        return (st.st_mode & 0o170000) == 0o040000

    walk_path(slot.ws_host, visit)
    return total[0]


def measure(agent, slot):
    """The tenant's usage so far (a dict; see the module doc). CPU and memory are read
    here (a few small cgroup files); the disk is measured by :func:`disk_bytes`, which
    the caller runs in a worker thread and passes in through :func:`finish`."""
    cg = agent.cgroups
    source = cg.mode if cg and cg.mode != "rlimit" else "agent"
    now = cpu_ns(agent, slot)
    tu = of(slot)
    out = {"source": source, "cpu_user_s": None, "cpu_system_s": None,
           "memory_peak_bytes": memory_peak(agent, slot), "notes": list(tu.notes)}
    if now is not None:
        out["cpu_user_s"] = max(0, now[0] - tu.cpu_base[0]) / 1e9
        out["cpu_system_s"] = max(0, now[1] - tu.cpu_base[1]) / 1e9
    elif source != "agent":
        out["notes"].append("no CPU accounting in this cgroup (cpuacct not mounted)")
    return out


def dispatch(agent, msg):
    """Answer a ``usage`` request ``{"slot": int, "disk": bool}``: the CPU and memory now
    (on the loop: a few small cgroup files); with ``disk``, then the slot's layer measured
    in the agent's ``disk`` worker thread (linear in its files), else at once with the
    largest size :mod:`.diskwatch` saw (None when it saw none)."""
    mid = msg.get("id")
    slot = agent.slots.get(msg.get("slot"))
    if slot is None:
        agent.send({"id": mid, "ok": False, "error": "no slot %r" % (msg.get("slot"),)})
        return
    try:
        out = measure(agent, slot)
    except Exception as exc:  # report, never die
        agent.send({"id": mid, "ok": False, "error": "usage: %s: %s" % (type(exc).__name__, exc)})
        return

    if not msg.get("disk"):
        peak = of(slot).disk_peak
        out["disk_bytes"] = None
        out["disk_peak_bytes"] = peak or None
        agent.send({"id": mid, "ok": True, "result": out})
        return

    def measured(fut):
        try:
            used = fut.result()
        except Exception:  # noqa: BLE001 - a walk that failed: the disk is not known
            used = None
            out["notes"].append("the slot's disk use could not be measured")
        if used is not None:
            disk_seen(slot, used)
        out["disk_bytes"] = used
        out["disk_peak_bytes"] = of(slot).disk_peak if used is not None else None
        agent.send({"id": mid, "ok": True, "result": out})

    fut = agent.loop.run_in_executor(agent.executor("disk"), disk_bytes, slot)
    fut.add_done_callback(measured)
