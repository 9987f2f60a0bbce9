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


def caps_report(limits, limit_mode, filesystem, tmpfs_mb, slot_disk_mb, isolation="bwrap",
                shared_tmpfs=False, contained=False, tmpfs_note="", shm=None, shm_note="",
                cpu_controller=None, disk_plan=(None, None, False, ""),
                slot_uids=True):
    """``{"memory": ..., "tmpfs": ..., "disk": ..., "pids": ..., "cpu": ...}``, each with
    the cap (MiB, a count, cores) and ``enforced``: how, or ``"none"`` with the reason.

    Args:
        limits: the profile's limits (``slot_memory_mb``, ``memory_mb``, ``pids``).
        limit_mode: ``"cgroup-v2"``, ``"cgroup-v1"`` or ``"rlimit"``.
        filesystem: ``"overlay"`` or ``"workspace-only"``.
        tmpfs_mb, slot_disk_mb: the caps (MiB) or None.
        isolation: ``"bwrap"`` or ``"none"`` (slots are plain processes of their own uid).
        shared_tmpfs: every memory-backed place of a slot is one capped tmpfs (:mod:`.slottmpfs`).
        contained: a layered root's slot cannot mount (no ``CAP_SYS_ADMIN``, no user namespaces).
        tmpfs_note: why ``shared_tmpfs`` could not be had, if it was wanted.
        shm: without bubblewrap, the memory-backed shared places' watch
            (:meth:`.shmwatch.ShmWatch.caps`), or None and ``shm_note`` says why.
        cpu_controller: with cgroups, whether the cpu controller is there (a delegated
            cgroup v2 may lack it); None: it is.
        disk_plan: :func:`.slotdisk.plan`'s ``(disks, size_mb, default, note)``.
        slot_uids: each slot runs as a uid of its own (the agent is root), so that
            ``RLIMIT_NPROC`` can count a slot's processes (without cgroups).
    """
    cgroup = limit_mode.startswith("cgroup")
    v2 = limit_mode == "cgroup-v2"
    mem = limits.get("slot_memory_mb")
    memory = {"mib": mem, "sandbox_mib": limits.get("memory_mb"),
              "enforced": ("cgroup v2 memory.max per slot (swap 0; an OOM kill takes the "
                           "slot's whole cgroup: memory.oom.group) and per sandbox" if v2 else
                           "cgroup memory.max per slot and per sandbox" if cgroup else
                           "RLIMIT_AS per process (address space, not a slot total)")}
    if isolation != "bwrap":
        tmpfs = dict(shm) if shm else {"mib": None, "places": [], "enforced": (
            shm_note if shm_note.startswith("none") else "none: " + (shm_note or "not watched"))}
        tmpfs["note"] = ("slots without bubblewrap share the sandbox's /tmp, /var/tmp and "
                         "/dev/shm (no mount of their own); a release removes what the slot's "
                         "uid left there" + (", and its pages are charged to the slot's memory "
                                             "cgroup" if cgroup else "")
                         + "; with slot_disk set, what it owns there counts against it too")
    elif filesystem == "overlay":
        tmpfs = {"mib": tmpfs_mb, "places": ["/dev/shm"],
                 "note": "/tmp, /run, /root, /home and the rest are in the slot's layer, on disk"}
        if cgroup:
            tmpfs["enforced"] = "size cap, and pages charged to the slot's memory cgroup"
        elif contained:
            tmpfs["enforced"] = ("size cap (the slot total: /dev is read-only and the slot, "
                                 "without CAP_SYS_ADMIN or user namespaces, cannot mount)")
        else:
            tmpfs["enforced"] = ("none: root in the slot may mount an uncapped tmpfs and "
                                 "rlimits do not count tmpfs pages (no cgroups here)")
    elif shared_tmpfs:
        tmpfs = {"mib": tmpfs_mb, "places": list(WRITABLE_TMPFS),
                 "enforced": "one size-capped tmpfs per slot holds every place (the slot total)"}
    else:
        tmpfs = {"mib": tmpfs_mb, "places": list(WRITABLE_TMPFS),
                 "enforced": "size cap per mount" + (
                     ", pages charged to the slot's memory cgroup" if cgroup else
                     " (each place, not a slot total: %s)" % (tmpfs_note or "no cgroups"))}
    disks, disk_mb, disk_default, disk_note = disk_plan
    if disks is not None:
        disk = {"mib": disks.size_mb, "inodes": disks.inodes, "default": disk_default,
                "enforced": "kernel: each writable layer is a file system of its own (ext4 on "
                            "a loop device) of this size and inode count; past it, ENOSPC",
                "note": disk_note}
        return _report(limits, limit_mode, cpu_controller, slot_uids, memory, tmpfs, disk)
    if not slot_disk_mb:
        disk = {"mib": None, "enforced": "none",
                "note": "set slot_disk to have what a slot writes watched (no kernel limit "
                        "here: %s)" % (disk_note or "no layered root")}
    elif filesystem == "overlay":
        disk = {"mib": slot_disk_mb, "enforced": "watched",
                "note": "measured every %gs while a command runs and when it ends; the "
                        "command is stopped past the limit (no kernel limit here: %s)"
                        % (DISK_WATCH_S, disk_note)}
    elif isolation != "bwrap":
        disk = {"mib": slot_disk_mb, "enforced": "watched",
                "note": "its workspace plus what the slot's uid owns in /tmp, /var/tmp and "
                        "/dev/shm, measured every %gs while a command runs and when it ends; "
                        "the command is stopped past the limit (no kernel limit here: %s)"
                        % (DISK_WATCH_S, disk_note)}
    else:
        disk = {"mib": slot_disk_mb, "enforced": "none",
                "note": "no layered root: the limit is not applied"}
    return _report(limits, limit_mode, cpu_controller, slot_uids, memory, tmpfs, disk)


def _report(limits, limit_mode, cpu_controller, slot_uids, memory, tmpfs, disk):
    cgroup = limit_mode.startswith("cgroup")
    v2 = limit_mode == "cgroup-v2"
    pids = {"count": limits.get("pids"),
            "enforced": "cgroup pids.max" if cgroup else "RLIMIT_NPROC (per uid)" if slot_uids
            else "none: no cgroups, and the slots share the agent's uid (RLIMIT_NPROC would "
                 "count all of its processes)"}
    cpu_on = cpu_controller if cpu_controller is not None else cgroup
    cpu = {"cores": limits.get("cpu"), "enforced": (
        ("cgroup v2 cpu.max per sandbox, cpu.weight per slot (equal shares)" if v2 else
         "cgroup cpu quota per sandbox, cpu.shares per slot (equal shares)") if cpu_on else
        "none: " + ("no cpu controller in the delegated cgroup" if cgroup
                    else "no cgroups (the admission limit follows the cores)"))}
    return {"memory": memory, "tmpfs": tmpfs, "disk": disk, "pids": pids, "cpu": cpu}
