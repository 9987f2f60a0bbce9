"""The engine benchmark's backends and what they leave behind, for ``engine.py`` and its
sections (``_engine_sections.py``): the run's profile name, the configs and started
backends it measures (tracked for the leak check), and the leak check itself (processes,
state directories, cgroups, orphans re-parented to this subreaper).
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

from _proc import descendants, proc_kind, proc_state, proc_stats

from hermes_modal_tool import SandboxConfig, ToolBackend

#: A profile name unique to this run. Sandbox ids, and so the agents' cgroup names, derive
#: from it: up to commit 893c51b two backends on one host both named their cgroups
#: "default-0", and one backend's reset/stop killed the other's slots.
PROFILE = f"bench{os.getpid()}"
#: State directories of every driver this run created (checked at the end).
OWN_PATHS: list[str] = []
#: Facts the started backends report (limit mode: cgroup-v1/v2 or rlimit).
FACTS: dict[str, Any] = {}


#: Fields every profile of the run gets (engine.py's ``--disk-limit``, ``--slot-disk``).
EXTRA: dict[str, Any] = {}


def cfg(**kw: Any) -> SandboxConfig:
    base = {"name": PROFILE, "slots_per_sandbox": 100, "min_sandboxes": 1, "max_sandboxes": 1,
            "execution_timeout_s": 60, **EXTRA}
    base.update(kw)
    return SandboxConfig(**base)


def track(b: ToolBackend) -> None:
    """Remember the state directories of ``b``'s drivers for the leak check (with
    ``host_processes``, its host processes' drivers')."""
    paths = [getattr(d, attr, None) for d in getattr(b, "_drivers", {}).values()
             for attr in ("state_root", "ctl_root")]
    if getattr(b, "host_processes", 1) > 1:
        paths += [info.get("state_root") for h in b.get_status()["host_processes"]
                  for info in h["drivers"].values()]
    for path in paths:
        if path is not None and str(path) not in OWN_PATHS:
            OWN_PATHS.append(str(path))


async def started(config: SandboxConfig, host_processes: int = 1) -> ToolBackend:
    """A started backend (stopped again if start fails), tracked for the leak check;
    its sandboxes spread over ``host_processes`` (``ToolBackend(host_processes=K)``)."""
    b = ToolBackend(config, host_processes=host_processes)
    try:
        await b.start()
    except BaseException:
        await b.stop()
        raise
    finally:
        track(b)
    pool = b.get_status()["pools"].get(config.name, {})
    FACTS.setdefault("limits", pool.get("limits"))
    FACTS.setdefault("isolation", pool.get("isolation"))
    return b


# -- what this run left behind ----------------------------------------------------------------
#: Orphans re-parented to us: the zombies reaped so far, the live ones at the last check.
ORPHANS: dict[str, int] = {"zombie": 0, "live": 0}


def reap_orphans() -> dict[str, list[int]]:
    """Our direct children that are not the agents we started: orphans re-parented to us.
    Zombies among them are reaped; live ones are reported (a leak)."""
    zombies, live = [], []
    for pid, f in proc_stats():
        if int(f[1]) != os.getpid():
            continue
        if f[0] == "Z":
            zombies.append(pid)
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        else:
            live.append(pid)
    return {"zombie": zombies, "live": live}


def _ours(pid: int) -> bool:
    """Whether a process belongs to this run's sandboxes (its cgroup names our profile)."""
    try:
        with open(f"/proc/{pid}/cgroup") as fh:
            return f"{PROFILE}-" in fh.read()  # cgroup "[<state dir>-]<profile>-<n>"
    except OSError:
        return False


def leftovers() -> dict[str, Any]:
    """What this run left behind: processes (``pgrep -f bwrap``), state dirs, cgroups.

    ``pgrep`` sees the whole machine; on a shared machine other users' sandboxes show
    up there too, so ours are told apart by cgroup (and by being our descendants).
    """
    pids = subprocess.run(["pgrep", "-f", "bwrap"], capture_output=True, text=True).stdout.split()
    live, zombie = [], []
    for p in pids:
        state = proc_state(int(p))
        if state != "?":  # "?": gone since pgrep saw it
            (zombie if state == "Z" else live).append(int(p))
    mine = [p for p in descendants(os.getpid()) if proc_kind(p) != "gone"]
    ours_live = sorted(set([p for p in live if _ours(p)] + [p for p in mine if p in live]))
    cgroups = []
    for root in ("/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids", "/sys/fs/cgroup/cpu", "/sys/fs/cgroup/unified",
                 "/sys/fs/cgroup"):
        try:
            cgroups += [os.path.join(root, "hermes-modal-tool", e)
                        for e in os.listdir(os.path.join(root, "hermes-modal-tool")) if f"{PROFILE}-" in e]
        except OSError:
            pass
    orphans = reap_orphans()
    ORPHANS["zombie"] += len(orphans["zombie"])
    ORPHANS["live"] = len(orphans["live"])
    return {"pgrep_bwrap_live": live, "pgrep_bwrap_zombie": zombie, "our_bwrap_live": ours_live,
            "orphans_reaped": ORPHANS["zombie"], "orphans_live": orphans["live"],
            "our_descendants": mine, "our_state_dirs": [d for d in OWN_PATHS if os.path.exists(d)],
            "our_cgroups": sorted(set(cgroups))}


def wait_clean(timeout: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        left = leftovers()
        clean = not (left["our_bwrap_live"] or left["our_descendants"] or left["our_state_dirs"]
                     or left["our_cgroups"] or left["orphans_live"])
        left["clean"] = clean
        if clean or time.monotonic() > deadline:
            return left
        time.sleep(0.05)
