"""The local driver's side of the agents' cgroups: starting an agent in a delegated
cgroup (a normal user under systemd, cgroup v2), the one warning where slots fall back
to rlimits, and the removal of a sandbox's cgroups after its agent exited.

Where each agent puts its cgroups: :mod:`hermes_modal_tool.agent.limits.cgroups` (v1) and
:mod:`hermes_modal_tool.agent.limits.cgroupv2`.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from ..agent.limits import cgroupv2

log = logging.getLogger("hermes_modal_tool")

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: How a normal user's agent gets a cgroup of its own to manage, on cgroup v2 under systemd.
SYSTEMD_RUN = ("systemd-run", "--user", "--scope", "--quiet", "--collect", "-p", "Delegate=yes")
_warned: set[str] = set()


def unified() -> bool:
    """Whether this host mounts cgroup v2 only (no v1 controller hierarchy)."""
    try:
        with open("/proc/self/mounts") as fh:
            types = {line.split()[2] for line in fh if len(line.split()) > 2}
    except OSError:
        return False
    return "cgroup2" in types and "cgroup" not in types


@functools.lru_cache(maxsize=1)
def delegation() -> tuple[list[str], str]:
    """``(argv prefix, note)``: how to start an agent so that it may manage its cgroup.

    Root, or a cgroup v1 host: ``([], "")`` (the agent manages cgroups itself). A normal
    user on cgroup v2 with a systemd user manager: :data:`SYSTEMD_RUN` (checked once per
    process with ``true``). Else ``([], why)``: the agent falls back to rlimits.
    """
    if os.geteuid() == 0 or not unified():
        return [], ""
    exe = shutil.which("systemd-run")
    if exe is None:
        return [], "systemd-run is not installed"
    env = _env()
    try:
        proc = subprocess.run([exe, *SYSTEMD_RUN[1:], "true"], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return [], f"systemd-run could not run: {exc}"
    if proc.returncode != 0:
        why = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        return [], f"systemd-run --user --scope failed: {why[-1] if why else proc.returncode}"
    return [exe, *SYSTEMD_RUN[1:], "--"], ""


def _env() -> dict[str, str]:
    """What ``systemd-run --user`` needs to find the user's manager."""
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.geteuid()}"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "XDG_RUNTIME_DIR": runtime}
    if os.environ.get("DBUS_SESSION_BUS_ADDRESS"):
        env["DBUS_SESSION_BUS_ADDRESS"] = os.environ["DBUS_SESSION_BUS_ADDRESS"]
    return env


def launch_env(base: dict[str, str]) -> dict[str, str]:
    """The agent's environment ``base`` plus what its systemd-run prefix needs, if any."""
    return {**base, **_env()} if delegation()[0] else base


def warn_fallback(info: dict[str, Any]) -> None:
    """Once per process and reason: say that an agent's slots have rlimits instead of
    cgroups, and what is then not enforced (``info``: the agent's init reply)."""
    if info.get("limits") != "rlimit":
        return
    why = info.get("limits_note") or "no cgroups"
    note = delegation()[1]
    if note:
        why += f"; {note}"
    if why in _warned:
        return
    _warned.add(why)
    log.warning(
        "slots get rlimits, not cgroups (%s): NOT enforced are a slot's memory total "
        "(RLIMIT_AS caps each process's address space), its CPU share and the sandbox's CPU "
        "quota, the process limit as a slot total (RLIMIT_NPROC counts per uid, and only "
        "where slots have a uid of their own), and tmpfs pages against memory", why)


def cgroup_dirs(name: str) -> list[Path]:
    """Where the agent of sandbox ``name`` makes its cgroups (v1 controllers, v2 as root)."""
    roots = [CGROUP_ROOT / c / "hermes-modal-tool" / name for c in ("memory", "pids", "cpu", "cpuacct")]
    return roots + [CGROUP_ROOT / "unified" / "hermes-modal-tool" / name,
                    CGROUP_ROOT / "hermes-modal-tool" / name]


def remove_cgroups(name: str) -> bool:
    """Kill and remove cgroups the agent made for this sandbox (after a crash, and with
    cgroup v2 always: its own leaf stays until it has exited).

    Returns True when none of them is left.
    """
    roots = cgroup_dirs(name)
    for root in roots:
        if not root.is_dir():
            continue
        if (root / "agent").is_dir():  # cgroup v2: agent/, slots/, slots/slot_N
            cgroupv2.remove_tree(str(root))
            continue
        for sub in sorted(root.glob("slot_*")) + [root]:
            try:
                for pid in (sub / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            except OSError:
                pass
        for sub in sorted(root.glob("slot_*")) + [root]:
            try:
                sub.rmdir()
            except OSError:
                pass
    return not any(root.is_dir() for root in roots)
