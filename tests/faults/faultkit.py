"""Fault injection helpers: find a backend's processes in /proc, kill them, and count
everything a backend created (processes, mounts, cgroups, temporary directories).

Everything is attributed to one backend only, so the checks hold while other test
runs or benchmarks use this machine:

- agents: children of this process whose stderr (fd 2) is a file in the backend's
  state root (the local driver sends each agent's stderr to ``{root}/{sandbox}.stderr``);
- slot processes: descendants of those agents, plus any process whose environment
  holds the test's token or whose command line names the state root (each slot's
  ``bwrap`` binds ``{root}/{sandbox}/ws/slot_N``), so orphans are found too;
- cgroups: ``/sys/fs/cgroup/*/hermes-modal-tool/{root name}-*`` (the local driver
  names a sandbox's cgroup ``{state root name}-{sandbox id}``);
- directories: the driver's state root (``/tmp/hermes-modal-tool-*``) and control
  root (``/dev/shm/hermes-modal-tool-*``);
- mounts: host mount table lines naming either root.
"""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from hermes_modal_tool import ExecutionResult, Slot, ToolBackend

CGROUP_GLOBS = ("/sys/fs/cgroup/*/hermes-modal-tool/*", "/sys/fs/cgroup/hermes-modal-tool/*")
TMP_GLOBS = ("/tmp/hermes-modal-tool-*", "/dev/shm/hermes-modal-tool-*")
#: Generous bound for "fails within ~1 s" on a loaded 2-core machine.
FAIL_FAST_S = 3.0


# -- /proc -------------------------------------------------------------------------------

@dataclass(frozen=True)
class P:
    pid: int
    ppid: int
    comm: str
    state: str
    cmdline: bytes
    nspid: tuple[int, ...]


def _read(path: str, mode: str = "r") -> Any:
    with open(path, mode) as fh:
        return fh.read()


def procs() -> dict[int, P]:
    """Every live (non-zombie) process."""
    out: dict[int, P] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            status = _read(f"/proc/{pid}/status")
            cmdline = _read(f"/proc/{pid}/cmdline", "rb")
        except OSError:
            continue
        f = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        state = f.get("State", "").strip()[:1]
        if state in ("Z", "X"):
            continue
        nspid = tuple(int(x) for x in f.get("NSpid", "0").split())
        out[pid] = P(pid, int(f["PPid"]), f["Name"].strip(), state, cmdline, nspid)
    return out


def descendants(root: int, table: dict[int, P] | None = None) -> list[int]:
    table = procs() if table is None else table
    kids: dict[int, list[int]] = {}
    for p in table.values():
        kids.setdefault(p.ppid, []).append(p.pid)
    out, todo = [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def ancestors(pid: int, table: dict[int, P]) -> list[int]:
    out = []
    while pid in table and table[pid].ppid not in (0, pid):
        pid = table[pid].ppid
        out.append(pid)
    return out


def environ_has(pid: int, needle: bytes) -> bool:
    try:
        return needle in _read(f"/proc/{pid}/environ", "rb")
    except OSError:
        return False


def kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


# -- one backend's footprint ---------------------------------------------------------------

@dataclass
class Footprint:
    """What one backend created, found through /proc, /sys/fs/cgroup and the file system."""

    backend: ToolBackend
    token: bytes
    state_root: str = ""
    ctl_root: str = ""
    agents_seen: set[int] = field(default_factory=set)

    def learn(self) -> None:
        """Read the driver's roots (call once the backend has started)."""
        for d in self.backend._drivers.values():  # the local driver's two roots
            self.state_root = str(getattr(d, "state_root", "") or self.state_root)
            self.ctl_root = str(getattr(d, "ctl_root", "") or self.ctl_root)
        assert self.state_root, "the backend has no local driver state root"

    # processes
    def agents(self, table: dict[int, P] | None = None) -> dict[str, int]:
        """sandbox id -> agent pid, for this backend's live agents."""
        table = procs() if table is None else table
        me = os.getpid()
        out = {}
        for p in table.values():
            if p.ppid != me or b"hermes_modal_tool.agent.main" not in p.cmdline:
                continue
            try:
                err = os.readlink(f"/proc/{p.pid}/fd/2")
            except OSError:
                continue
            if err.startswith(self.state_root + "/") and err.endswith(".stderr"):
                out[os.path.basename(err)[:-len(".stderr")]] = p.pid
        self.agents_seen.update(out.values())
        return out

    def processes(self) -> list[P]:
        table = procs()
        mine = set(self.agents(table).values())
        for a in list(mine):
            mine.update(descendants(a, table))
        roots = [r.encode() for r in (self.state_root, self.ctl_root) if r]
        me = os.getpid()
        for p in table.values():
            if p.pid == me:
                continue
            if any(r in p.cmdline for r in roots) or (
                    p.comm in ("bwrap", "bash", "sleep", "python3") and environ_has(p.pid, self.token)):
                mine.add(p.pid)
        return [table[p] for p in sorted(mine) if p in table]

    def slot_shell(self, slot: Slot, table: dict[int, P] | None = None) -> int | None:
        """Host pid of the slot's bash: ``bash --noprofile --norc``, pid 2 of its namespace,
        below the slot's own bwrap, below the slot's sandbox's agent."""
        table = procs() if table is None else table
        agent = self.agents(table).get(slot.sandbox_id)
        if agent is None:
            return None
        base = f"{self.state_root}/{slot.sandbox_id}"
        # The slot's bwrap names its workspace, or its layered root (fs/slot_N/merged).
        marks = (f"{base}/ws/slot_{slot.index}\0".encode(),
                 f"{base}/fs/slot_{slot.index}/layer-".encode())
        for pid in descendants(agent, table):
            p = table[pid]
            if p.comm != "bash" or p.cmdline != b"bash\0--noprofile\0--norc\0" or p.nspid[-1:] != (2,):
                continue
            up = ancestors(pid, table)
            if agent in up and any(m in table[a].cmdline for a in up if a in table for m in marks):
                return pid
        return None

    def slot_bwraps(self, slot: Slot) -> list[int]:
        """Host pids of the slot's bwrap processes (the outer one and its init): while one
        runs, the slot's shell holds its output pipe, so the agent has not yet seen it end."""
        table = procs()
        base = f"{self.state_root}/{slot.sandbox_id}"
        marks = (f"{base}/ws/slot_{slot.index}\0".encode(),
                 f"{base}/fs/slot_{slot.index}/layer-".encode())
        return [p.pid for p in table.values()
                if p.comm == "bwrap" and any(m in p.cmdline for m in marks)]

    def sandbox_tree(self, sandbox_id: str) -> list[int]:
        """The sandbox's agent and every process below it."""
        table = procs()
        agent = self.agents(table)[sandbox_id]
        return [agent] + descendants(agent, table)

    # everything else
    def cgroups(self) -> list[str]:
        name = os.path.basename(self.state_root) + "-"
        return sorted(p for g in CGROUP_GLOBS for p in glob.glob(g)
                      if os.path.basename(p).startswith(name))

    def cgroups_of(self, sandbox_id: str) -> list[str]:
        name = f"{os.path.basename(self.state_root)}-{sandbox_id}"
        return [p for p in self.cgroups() if os.path.basename(p) == name]

    def dirs(self) -> list[str]:
        return sorted(d for d in (self.state_root, self.ctl_root) if d and os.path.exists(d))

    def mounts(self) -> list[str]:
        roots = [r for r in (self.state_root, self.ctl_root) if r]
        lines = _read("/proc/self/mounts").splitlines()
        return [ln for ln in lines if any(r in ln for r in roots)]

    def count(self) -> dict[str, Any]:
        return {"processes": self.processes(), "cgroups": self.cgroups(),
                "dirs": self.dirs(), "mounts": self.mounts()}

    async def settled_count(self, grace: float = 3.0) -> dict[str, Any]:
        """The count once it is empty, or after ``grace`` seconds (the kernel reaps)."""
        deadline = time.monotonic() + grace
        while True:
            c = await asyncio.to_thread(self.count)
            if not any(c.values()) or time.monotonic() > deadline:
                return c
            await asyncio.sleep(0.05)


def machine_globals() -> dict[str, set[str]]:
    """Every hermes-modal-tool temp dir and cgroup on the machine (any program's)."""
    return {"tmp": {p for g in TMP_GLOBS for p in glob.glob(g)},
            "cgroups": {p for g in CGROUP_GLOBS for p in glob.glob(g)
                        if os.path.isdir(p)}}


# -- calls -----------------------------------------------------------------------------------

async def timed_batch(backend: ToolBackend, requests: list) -> tuple[list[ExecutionResult], float]:
    """Run a batch; return its results and the monotonic time it finished."""
    results = await backend.execute_batch(requests)
    return results, time.monotonic()


async def wait_for_processes(fp: Footprint, slots: list[Slot], comm: str = "sleep",
                             timeout: float = 10.0) -> None:
    """Wait until every slot's shell has a ``comm`` child running (the calls are in flight)."""
    deadline = time.monotonic() + timeout
    while True:
        table = procs()
        missing = []
        for s in slots:
            shell = fp.slot_shell(s, table)
            if shell is None or not any(table[c].comm == comm for c in descendants(shell, table)):
                missing.append(s.slot_id)
        if not missing:
            return
        assert time.monotonic() < deadline, f"calls never started in {missing}"
        await asyncio.sleep(0.05)
