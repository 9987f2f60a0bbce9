"""The machine the benchmarks run on, and its load: what ``run_all.py`` records beside
each section's numbers (the hardware and versions; the load average and the cores busy
elsewhere while each section ran), and its wait for a quiet machine before a section.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _proc import CpuStep, busy_cpu_s, meminfo, quantile

HERE = Path(__file__).resolve().parent
perf = time.perf_counter
#: git reads only: no optional locks, so no index refresh is written (here and in the scripts)
READ_ONLY_GIT = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}


def log(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    with open("/proc/cpuinfo") as fh:
        cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    try:
        from hermes_modal_tool.drivers.local import find_bwrap
        bwrap = subprocess.run([find_bwrap(), "--version"], capture_output=True, text=True,
                               check=False).stdout.strip()
    except Exception as exc:  # noqa: BLE001 - informational only
        bwrap = f"unavailable ({exc})"
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        cgroup = "v2"
    else:
        cgroup = "v1 (hybrid)" if os.path.isdir("/sys/fs/cgroup/unified") else "v1"

    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(HERE), *args], capture_output=True, text=True,
                           env=READ_ONLY_GIT, check=False)
        return r.stdout.strip()

    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)),
            "mem_total_gib": round(meminfo()["MemTotal"] / 1024 / 1024, 1),
            "kernel": platform.release(), "os": platform.platform(terse=True),
            "python": sys.version.split()[0], "cgroup": cgroup, "root": os.geteuid() == 0,
            "bwrap": bwrap,
            "commit": git("rev-parse", "--short=12", "HEAD") or None,
            "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
            "versions": {p: ver(p) for p in ("modal", "swe-rex", "langchain-modal",
                                              "deepagents", "matplotlib")}}


class LoadSampler:
    """The 1-minute load average and the busy cores, every ``every`` seconds, on a thread."""

    def __init__(self, every: float = 2.0) -> None:
        self.every = every
        self.samples: list[tuple[float, float, float]] = []  # (t, loadavg_1m, busy cores)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)
        self._t0 = perf()

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        b0, t0 = busy_cpu_s(), perf()
        while not self._stop.wait(self.every):
            b1, t1 = busy_cpu_s(), perf()
            self.samples.append((t1 - self._t0, os.getloadavg()[0], (b1 - b0) / (t1 - t0)))
            b0, t0 = b1, t1

    def summary(self) -> dict[str, Any]:
        la = [s[1] for s in self.samples] or [os.getloadavg()[0]]
        busy = [s[2] for s in self.samples] or [math.nan]
        step = max(1, len(self.samples) // 60)  # at most ~60 points kept
        return {"loadavg_1m": {"min": min(la), "median": quantile(la, 0.5), "max": max(la)},
                "busy_cores": {"median": quantile(busy, 0.5), "max": max(busy)},
                "series_t_load_busy": [list(s) for s in self.samples[::step]]}


def wait_quiet(max_wait: float, max_busy: float, max_load: float = math.inf) -> dict[str, Any]:
    """Wait up to ``max_wait`` s for a quiet machine: fewer than ``max_busy`` cores busy in two
    3 s windows in a row (this process is idle meanwhile, so that is everyone else) and the
    1-minute load average below ``max_load``."""
    t0, quiet, busy, said = perf(), 0, math.nan, False
    while max_wait > 0 and perf() - t0 < max_wait:
        b0, t1 = busy_cpu_s(), perf()
        time.sleep(3.0)
        busy = (busy_cpu_s() - b0) / (perf() - t1)
        quiet = quiet + 1 if busy < max_busy and os.getloadavg()[0] < max_load else 0
        if quiet >= 2:
            break
        if not said and not quiet:
            log(f"waiting up to {max_wait:.0f} s for a quiet machine: {busy:.2f} cores busy "
                f"(< {max_busy:g} wanted), load average {os.getloadavg()[0]:.1f}"
                + (f" (< {max_load:g} wanted)" if max_load < math.inf else ""))
            said = True
    return {"waited_s": perf() - t0, "busy_cores": busy, "quiet": quiet >= 2,
            "loadavg_1m": os.getloadavg()[0]}


@contextlib.contextmanager
def section(name: str, report: dict[str, Any], wait: tuple[float, float]) -> Iterator[None]:
    """A measured section, after waiting (``wait``: seconds at most, cores busy at most) for
    the machine to be quiet: its wall time, the load and the cores busy elsewhere meanwhile;
    an exception is recorded (the run goes on with the next section)."""
    before = wait_quiet(*wait)
    log(f"{name} (load average {os.getloadavg()[0]:.1f})")
    la0 = os.getloadavg()[0]
    with CpuStep(name) as step:
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - one failed section must not lose the others
            report.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:500]
            log(f"{name} FAILED: {type(exc).__name__}: {exc}"[:300])
    r = step.result()
    r.update(loadavg_1m_start=la0, loadavg_1m_end=os.getloadavg()[0],
             waited_before_s=before["waited_s"], busy_cores_before=before["busy_cores"])
    report["sections"].append(r)
    log(f"{name}: {r['wall_s']:.1f} s ({r['other_cores_low']:.2f}..{r['other_cores']:.2f} "
        "cores busy elsewhere)")
