"""Section s with separate backends (``engine.py --separate-backends K,...``): the same
slots and sandboxes as a row of ``_scaling.py``, split over K host processes, each with a
``ToolBackend`` of its own owning ``sandboxes / K`` of the sandboxes and their slots (the
way RL frameworks run several rollout workers, and the route the README gives past one
host process's event loop), all driving their rounds at once.

The parent starts K children (this file with ``--child``), each of which starts its
backend, acquires its slots, warms them up and waits for its agents to go quiet
(``_scaling.agents_quiet``), then says ``ready``. For each run the parent writes ``go`` to
every child at once; each runs its rounds of ``echo i`` and answers with when it began
and ended (``time.perf_counter``, CLOCK_MONOTONIC, one clock for all processes). A run's
calls/s is all the calls over the time from the first child's start to the last one's
end. CPU per call by part as in ``_scaling.py``: the children name themselves
``hmt-host`` (``/proc/PID/comm``), so their CPU is the host's; their agents and shells
are descendants of this process too.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

#: The name a child host process gives itself (``prctl(PR_SET_NAME)``), for ``proc_kind``.
CHILD_COMM = b"hmt-host"
PR_SET_NAME = 15


def splits(sandboxes: int, processes: Sequence[int]) -> list[int]:
    """The host process counts of ``processes`` that split ``sandboxes`` evenly, above 1."""
    return [k for k in processes if 1 < k <= sandboxes and sandboxes % k == 0]


def _send(proc: subprocess.Popen, line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _answer(proc: subprocess.Popen, err: Any, what: str) -> dict[str, Any]:
    """The child's next JSON line; RuntimeError with the end of its stderr (the file
    ``err``) if it ended first."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        err.seek(0)
        raise RuntimeError(f"host process {proc.pid} ended ({proc.returncode}) before {what}: "
                           f"{err.read()[-2000:]}")
    return json.loads(line)


def one_count_procs(slots: int, sandboxes: int, processes: int, rounds: int, runs: int,
                    loop_name: str, extra: dict[str, Any], own_paths: list[str]) -> dict[str, Any]:
    """``runs`` runs of ``rounds`` rounds over ``slots`` slots and ``sandboxes`` sandboxes
    split evenly over ``processes`` host processes: a row as ``_scaling.one_count`` makes
    it, with ``host_processes``. ``own_paths`` gets the children's state directories (the
    run's leak check)."""
    from _scaling import cpu_by_kind, row

    share = {"slots": slots // processes, "sandboxes": sandboxes // processes, "rounds": rounds,
             "loop": loop_name, "extra": extra}
    if share["slots"] * processes != slots:
        raise ValueError(f"--scale-slots {slots} does not split over {processes} host processes")
    here = os.path.dirname(os.path.abspath(__file__))
    hosts = []  # (child, the file its stderr goes to: a pipe could fill and stop it)
    for _ in range(processes):
        err = tempfile.TemporaryFile("w+")
        hosts.append((subprocess.Popen([sys.executable, os.path.join(here, "_scaling_procs.py"), "--child",
                                        json.dumps(share)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=err, text=True, cwd=here), err))
    walls: list[float] = []
    wrong = 0
    cpu: dict[str, float] = {}
    settle = 0.0
    try:
        for c, err in hosts:
            settle = max(settle, _answer(c, err, "ready")["settle_s"])
        for _ in range(runs):
            c0 = cpu_by_kind()
            for c, _err in hosts:
                _send(c, "go")
            done = [_answer(c, err, "its rounds") for c, err in hosts]
            for k, v in cpu_by_kind().items():
                cpu[k] = cpu.get(k, 0.0) + v - c0.get(k, 0.0)
            walls.append(max(d["t1"] for d in done) - min(d["t0"] for d in done))
            wrong += sum(d["wrong"] for d in done)
        for c, _err in hosts:
            _send(c, "end")
        for c, err in hosts:
            own_paths.extend(p for p in _answer(c, err, "its stop")["own_paths"] if p not in own_paths)
    finally:
        for c, err in hosts:
            if c.stdin is not None and not c.stdin.closed:
                c.stdin.close()  # a child still waiting for "go" ends its rounds and stops
            try:
                c.wait(timeout=120)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()
            err.close()
    cpu.pop("host", None)  # this process only waits; the hosts are the children
    cpu["host"] = cpu.pop("hmt-host", 0.0)
    return {**row(sandboxes, slots, rounds, walls, wrong, settle, cpu), "host_processes": processes,
            "split": "separate"}


async def _child(share: dict[str, Any]) -> None:
    """One host process: its backend and slots, then a run of rounds per ``go`` line."""
    import _engine_backends
    from _rounds import echo_rounds
    from _scaling import held_slots

    _engine_backends.EXTRA.update(share["extra"])
    loop = asyncio.get_running_loop()
    async with held_slots(share["slots"], share["sandboxes"]) as (b, use, settle_s):
        print(json.dumps({"settle_s": settle_s}), flush=True)
        while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "go":
            t0 = time.perf_counter()
            _wall, wrong = await echo_rounds(b, use, share["rounds"])
            print(json.dumps({"t0": t0, "t1": time.perf_counter(), "wrong": wrong}), flush=True)
    print(json.dumps({"own_paths": _engine_backends.OWN_PATHS}), flush=True)


def child_main(share: dict[str, Any]) -> None:
    """Run one child host process on the event loop ``share["loop"]`` names."""
    from _scaling import loops, run_on

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(CHILD_COMM), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # then its CPU is counted as an agent's: the table says so by a zero host
    run_on(loops([share["loop"]])[share["loop"]], _child(share))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--child":
        sys.exit("usage: _scaling_procs.py --child SHARE_JSON (started by engine.py --sections s)")
    child_main(json.loads(sys.argv[2]))
