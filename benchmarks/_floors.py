"""Floors for the engine benchmark, measured in the same run as the engine's figures.

- a raw persistent bash answering ``echo`` (one shell, one round trip at a time);
- raw persistent bashes answering trivial commands in rounds (the most calls/s the
  machine gives bash itself, with no sandbox, agent or host in between), and the same
  with each bash in a memory, pids and cpu cgroup of its own below a common parent, as a
  slot's shell is (the kernel's accounting per cgroup is part of every call's cost);

The floor of a shell's start (``bwrap ... true``) is in ``_fresh.py``, beside section f.
"""

from __future__ import annotations

import os
import resource
import selectors
import subprocess
import time
from typing import Any

MARK = b"\x1e\n"
perf = time.perf_counter


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _bash(cgroup: list[str] | None = None) -> subprocess.Popen:
    """A persistent bash; ``cgroup``: files its pid is written to before it runs."""
    def join() -> None:
        for path in cgroup or ():
            with open(path, "w") as fh:
                fh.write("0")

    return subprocess.Popen(["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, bufsize=0, preexec_fn=join if cgroup else None)


#: Controllers of a slot's cgroup (as ``hermes_modal_tool/agent/limits/cgroups.py`` makes them).
SLOT_CONTROLLERS = ("memory", "pids", "cpu")


def slot_cgroups(n: int) -> tuple[list[list[str]], list[str]] | None:
    """``n`` cgroups, each with :data:`SLOT_CONTROLLERS`, below a new parent (v1 or v2):
    ``(the files to join each, the directories to remove, deepest first)``, or None when
    this process cannot make them (not root, no such controllers)."""
    tag = f"hmt-floor-{os.getpid()}"
    made: list[str] = []
    try:
        if all(os.path.isdir(f"/sys/fs/cgroup/{c}") for c in SLOT_CONTROLLERS):
            parents = [f"/sys/fs/cgroup/{c}/{tag}" for c in SLOT_CONTROLLERS]
            for d in parents:
                os.mkdir(d)
                made.append(d)
            joins = []
            for i in range(n):
                files = []
                for d in parents:
                    os.mkdir(f"{d}/s{i}")
                    made.append(f"{d}/s{i}")
                    files.append(f"{d}/s{i}/tasks")
                joins.append(files)
        elif os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            parent = f"/sys/fs/cgroup/{tag}"
            os.mkdir(parent)
            made.append(parent)
            with open(f"{parent}/cgroup.subtree_control", "w") as fh:
                fh.write(" ".join("+" + c for c in SLOT_CONTROLLERS))
            joins = []
            for i in range(n):
                os.mkdir(f"{parent}/s{i}")
                made.append(f"{parent}/s{i}")
                joins.append([f"{parent}/s{i}/cgroup.procs"])
        else:
            return None
    except OSError:
        _remove_dirs(made[::-1])
        return None
    return joins, made[::-1]


def _remove_dirs(dirs: list[str]) -> None:
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:
            pass


def _ask(proc: subprocess.Popen, command: bytes) -> bytes:
    os.write(proc.stdin.fileno(), command + b"; printf '\\036\\n'\n")
    out = b""
    while not out.endswith(MARK):
        out += os.read(proc.stdout.fileno(), 65536)
    return out[:-len(MARK)]


def raw_bash_echo(n: int, warm: int) -> list[float]:
    """Round trips (s) of ``echo hi`` to one persistent bash over pipes."""
    proc = _bash()
    try:
        for _ in range(warm):
            _ask(proc, b"echo hi")
        xs = []
        for _ in range(n):
            t0 = perf()
            assert _ask(proc, b"echo hi") == b"hi\n"
            xs.append(perf() - t0)
        return xs
    finally:
        proc.stdin.close()
        proc.wait()


def raw_bash_throughput(shells: int, rounds: int, cgroups: bool = False) -> dict[str, Any]:
    """``shells`` persistent bashes, ``rounds`` rounds of ``echo i`` to each: calls/s and the
    CPU per call of bash and of this driver (the floor: no sandbox, agent or host);
    ``cgroups``: each bash in cgroups of its own (:func:`slot_cgroups`; ``{"error": ...}``
    when they cannot be made here)."""
    groups = slot_cgroups(shells) if cgroups else None
    if cgroups and groups is None:
        return {"error": "no memory, pids and cpu cgroups can be made here (not root?)"}
    try:
        result = _rounds([_bash(groups[0][i] if groups else None) for i in range(shells)], rounds)
    finally:
        if groups:
            _remove_dirs(groups[1])
    return result


def _rounds(procs: list[subprocess.Popen], rounds: int) -> dict[str, Any]:
    shells = len(procs)
    sel = selectors.DefaultSelector()
    for p in procs:
        os.set_blocking(p.stdout.fileno(), False)
        sel.register(p.stdout.fileno(), selectors.EVENT_READ, p)
    for p in procs:  # warm: every shell has run a command
        os.write(p.stdin.fileno(), b"printf '\\036\\n'\n")
    _drain(sel, shells)
    c0, own0 = _children_cpu(), time.process_time()
    t0 = perf()
    for i in range(rounds):
        line = b"echo %d; printf '\\036\\n'\n" % i
        for p in procs:
            os.write(p.stdin.fileno(), line)
        _drain(sel, shells)
    wall = perf() - t0
    own = time.process_time() - own0
    for p in procs:
        p.stdin.close()
    for p in procs:
        p.wait()
    sel.close()
    bash = _children_cpu() - c0  # the shells' CPU, counted once they are reaped
    calls = shells * rounds
    return {"shells": shells, "calls": calls, "calls_per_s": calls / wall,
            "cpu_us_per_call": {"bash": bash / calls * 1e6, "driver": own / calls * 1e6}}


def _drain(sel: selectors.BaseSelector, n: int) -> None:
    pending: dict[int, bytes] = {}
    done = 0
    while done < n:
        for key, _ in sel.select():
            data = pending.get(key.fd, b"") + os.read(key.fd, 65536)
            if data.endswith(MARK):
                pending.pop(key.fd, None)
                done += 1
            else:
                pending[key.fd] = data
