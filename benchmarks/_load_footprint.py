"""What ``load.py`` watches while it runs and after: what one backend created and left
behind (``Footprint``: processes, cgroups, mounts, state directories), the orphaned slot
processes this subreaper reaps, and the memory of the run (``MemorySampler``:
MemAvailable's low-water mark and the PSS of our processes).
"""

from __future__ import annotations

import glob
import os
import threading
import time

from _proc import descendants, meminfo, proc_stats, pss_kib

from hermes_modal_tool import ToolBackend

CGROUP_GLOBS = ("/sys/fs/cgroup/*/hermes-modal-tool/*", "/sys/fs/cgroup/hermes-modal-tool/*")


class Footprint:
    """What one backend created: its agents and their descendants, processes in its
    cgroups (orphans too), its cgroups, state directories and mounts."""

    def __init__(self, backend: ToolBackend) -> None:
        self.roots: list[str] = []
        for d in backend._drivers.values():  # the local driver's state and control roots
            self.roots += [str(p) for p in (getattr(d, "state_root", None), getattr(d, "ctl_root", None)) if p]
        self.cg_prefix = os.path.basename(self.roots[0]) + "-" if self.roots else "\0"

    def agents(self) -> list[int]:
        out = []
        me = os.getpid()
        for pid in [p for p, f in proc_stats() if f[0] != "Z" and int(f[1]) == me]:
            try:
                err = os.readlink(f"/proc/{pid}/fd/2")
            except OSError:
                continue
            if self.roots and err.startswith(self.roots[0] + "/"):
                out.append(pid)
        return out

    def processes(self) -> list[int]:
        mine = set()
        for a in self.agents():
            mine.add(a)
            mine.update(descendants(a, live_only=True))
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cgroup") as fh:
                        if "/hermes-modal-tool/" + self.cg_prefix in fh.read():
                            mine.add(int(entry))
                except OSError:
                    pass
        return sorted(mine)

    def cgroups(self) -> list[str]:
        return sorted(p for g in CGROUP_GLOBS for p in glob.glob(g)
                      if os.path.basename(p).startswith(self.cg_prefix))

    def mounts(self) -> list[str]:
        with open("/proc/self/mounts") as fh:
            return [ln for ln in fh.read().splitlines() if any(r in ln for r in self.roots)]

    def count(self) -> dict[str, list]:
        return {"processes": self.processes(), "cgroups": self.cgroups(), "mounts": self.mounts(),
                "dirs": [d for d in self.roots if os.path.exists(d)]}

    def settled(self, grace: float = 5.0, reap: bool = False) -> dict[str, list]:
        deadline = time.monotonic() + grace
        while True:
            if reap:
                reap_zombie_children()
            c = self.count()
            if not any(c.values()) or time.monotonic() > deadline:
                return c
            time.sleep(0.1)


#: Orphaned slot processes reaped so far (one item, counted up in place; load.py reads it).
ORPHANS_REAPED = [0]


def reap_zombie_children() -> int:
    """Reap zombies among our children that are not agents: slot processes orphaned by a
    kill and re-parented to us (a subreaper). Agents are left to the engine to wait for."""
    n = 0
    me = os.getpid()
    for pid, fields in proc_stats():
        if fields[0] != "Z" or int(fields[1]) != me:
            continue
        try:
            with open(f"/proc/{pid}/comm") as fh:
                if fh.read().startswith("python"):
                    continue
            os.waitpid(pid, os.WNOHANG)
            n += 1
        except (OSError, ChildProcessError):
            pass
    ORPHANS_REAPED[0] += n
    return n


class MemorySampler(threading.Thread):
    """MemAvailable every 0.2 s (low-water mark); PSS of our processes every ``pss_every`` s."""

    def __init__(self, pss_every: float = 5.0, reap: bool = False) -> None:
        super().__init__(daemon=True, name="load-memory-sampler")
        self.stop_event = threading.Event()
        self.pss_every = pss_every
        self.reap = reap
        self.low_kib = meminfo()["MemAvailable"]
        self.pss_peak_kib = 0
        self.pss_peak_procs = 0

    def pss_now(self) -> tuple[int, int]:
        pids = [os.getpid()] + descendants(os.getpid(), live_only=True)
        return sum(pss_kib(p)[0] for p in pids), len(pids)

    def run(self) -> None:
        next_pss = time.monotonic()
        while not self.stop_event.wait(0.2):
            self.low_kib = min(self.low_kib, meminfo()["MemAvailable"])
            if time.monotonic() >= next_pss:
                if self.reap:
                    reap_zombie_children()
                pss, n = self.pss_now()
                if pss > self.pss_peak_kib:
                    self.pss_peak_kib, self.pss_peak_procs = pss, n
                next_pss = time.monotonic() + self.pss_every

    def stop(self) -> None:
        self.stop_event.set()
        self.join(10)
