"""What each slot may use of the sandbox's shared resources, and how each cap is enforced.

This is what ``get_status()["pools"][profile]["caps"]`` shows. Stdlib-only (Python 3.8).
"""

from .diskwatch import DISK_WATCH_S
from .isolation import WRITABLE_TMPFS


def tmpfs_mb_for(limits):
    """Each writable tmpfs of a slot may hold at most half its memory limit (MiB): a full
    ``/tmp`` fails with ENOSPC instead of growing without bound. None without a limit."""
    mem = limits.get("slot_memory_mb") or limits.get("memory_mb")
    return max(16, int(mem) // 2) if mem else None


def caps_report(limits, limit_mode, filesystem, tmpfs_mb, slot_disk_mb):
    """``{"memory": ..., "tmpfs": ..., "disk": ..., "pids": ...}``, each with the cap (MiB
    or a count) and ``enforced``: how, or ``"none"`` with the reason."""
    cgroup = limit_mode.startswith("cgroup")
    mem = limits.get("slot_memory_mb")
    memory = {"mib": mem, "sandbox_mib": limits.get("memory_mb"),
              "enforced": ("cgroup memory.max per slot and per sandbox" if cgroup else
                           "RLIMIT_AS per process (address space, not a slot total)")}
    if filesystem == "overlay":
        # Root in its own user namespace may mount a tmpfs of any size: only the memory
        # cgroup, which charges tmpfs pages to the slot that wrote them, bounds it.
        tmpfs = {"mib": tmpfs_mb, "places": ["/dev/shm"],
                 "enforced": ("size cap, and pages charged to the slot's memory cgroup" if cgroup
                              else "none: root in the slot may mount an uncapped tmpfs and "
                                   "rlimits do not count tmpfs pages (no cgroups here)"),
                 "note": "/tmp, /run, /root, /home and the rest are in the slot's layer, on disk"}
    else:
        tmpfs = {"mib": tmpfs_mb, "places": list(WRITABLE_TMPFS),
                 "enforced": "size cap per mount" + (", pages charged to the slot's memory cgroup"
                                                     if cgroup else "")}
    if not slot_disk_mb:
        disk = {"mib": None, "enforced": "none", "note": "set slot_disk to cap what a slot writes"}
    elif filesystem == "overlay":
        disk = {"mib": slot_disk_mb, "enforced": "watched",
                "note": "measured every %gs while a command runs and when it ends; the "
                        "command is stopped past the limit" % DISK_WATCH_S}
    else:
        disk = {"mib": slot_disk_mb, "enforced": "none",
                "note": "no layered root: the limit is not applied"}
    pids = {"count": limits.get("pids"),
            "enforced": "cgroup pids.max" if cgroup else "RLIMIT_NPROC (per uid)"}
    return {"memory": memory, "tmpfs": tmpfs, "disk": disk, "pids": pids}
