"""GPU profiles on the host: Modal's ``gpu`` syntax, which of the host's GPUs a local
sandbox gets, and the GPU part of ``get_status()``.

Discovery and what a slot is given live in the agent's :mod:`.agent.gpu` (stdlib-only,
so that on Modal the agent finds the container's GPUs itself); this module adds what
only the host does: the typed errors, the CDI spec (JSON or YAML), the devices cgroup
check and the status sampler.

Settings (environment variables of the process that runs the backend):

- ``HERMES_MODAL_TOOL_GPU=ignore``: run the sandboxes of ``gpu`` profiles without GPUs
  on purpose (the same profiles file on a machine without one); a warning once per
  profile. Unset (or ``require``), a ``gpu`` profile on a machine without a GPU of its
  type fails to start with :class:`~hermes_modal_tool.errors.GpuUnavailableError`.
- ``HERMES_MODAL_TOOL_GPU_ROOT``: for tests only. A stand-in tree (``dev/nvidia0`` and
  friends made with ``mknod``, ``proc/driver/nvidia/gpus/*/information``, a driver
  library directory) that discovery reads instead of ``/``; its files are given to
  slots at the same paths without the prefix.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .agent.limits import gpu as agent_gpu
from .errors import GpuMismatchError, GpuUnavailableError

log = logging.getLogger("hermes_modal_tool")

GPU_MODE_ENV = "HERMES_MODAL_TOOL_GPU"
GPU_ROOT_ENV = "HERMES_MODAL_TOOL_GPU_ROOT"
#: Most GPUs one sandbox may ask for (Modal's limit).
MAX_GPUS = 8
CDI_DIRS = ("etc/cdi", "var/run/cdi")
_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,31}!?$")
_warned: set[str] = set()


@dataclass(frozen=True)
class GpuRequest:
    """A parsed ``gpu`` value: ``type`` (upper case, None for ``any``) and ``count``
    (GPUs per sandbox, shared by its slots)."""

    type: str | None
    count: int

    def __str__(self) -> str:
        return f"{self.type or 'any'}:{self.count}"


def parse_gpu(value: str) -> GpuRequest:
    """Parse Modal's syntax: ``"T4"``, ``"H100"``, ``"A100-80GB"``, ``"H100!"``,
    ``"H100:2"``, ``"any"``, ``"any:2"`` (case does not matter).

    Raises:
        ValueError: anything else (the message quotes the value and the syntax).
    """
    text = value.strip() if isinstance(value, str) else value
    if not isinstance(text, str) or not text:
        raise ValueError(f"must be a GPU type such as 'T4', 'H100:2' or 'any', got {value!r}")
    kind, sep, count = text.partition(":")
    if not _TYPE.match(kind) or (sep and not count.isdigit()):
        raise ValueError(f"{value!r} is not a GPU: give a type and an optional count, "
                         "such as 'T4', 'A100-80GB', 'H100:2' or 'any'")
    n = int(count) if sep else 1
    if not 1 <= n <= MAX_GPUS:
        raise ValueError(f"{value!r}: the count must be 1 to {MAX_GPUS} GPUs per sandbox, got {n}")
    kind = kind.upper()
    return GpuRequest(None if kind == "ANY" else kind, n)


def gpu_mode() -> str:
    """``"require"`` (default) or ``"ignore"`` (from ``HERMES_MODAL_TOOL_GPU``).

    Raises:
        GpuUnavailableError: the variable has another value (named).
    """
    mode = (os.environ.get(GPU_MODE_ENV) or "require").strip().lower()
    if mode not in ("require", "ignore"):
        from .errors import ConfigError

        raise ConfigError(f"{GPU_MODE_ENV}={os.environ.get(GPU_MODE_ENV)!r}: expected 'require' or 'ignore'")
    return mode


def discovery_root() -> str:
    """``/``, or the stand-in tree of ``HERMES_MODAL_TOOL_GPU_ROOT`` (tests)."""
    return os.environ.get(GPU_ROOT_ENV) or "/"


def read_cdi(root: str = "/") -> dict[str, Any] | None:
    """The ``containerEdits`` of the first CDI spec of kind ``nvidia.com/gpu`` in
    ``/etc/cdi`` or ``/var/run/cdi`` (JSON or YAML), with each device's edits merged
    in; None when there is none or it cannot be read (then files are discovered)."""
    import yaml

    for rel in CDI_DIRS:
        folder = Path(root, rel)
        try:
            names = sorted(p for p in folder.iterdir() if p.suffix in (".json", ".yaml", ".yml"))
        except OSError:
            continue
        for path in names:
            try:
                text = path.read_text()
                spec = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
            except (OSError, ValueError, yaml.YAMLError) as exc:
                log.warning("CDI spec %s not read: %s", path, exc)
                continue
            if not isinstance(spec, dict) or spec.get("kind") != "nvidia.com/gpu":
                continue
            edits = dict(spec.get("containerEdits") or {})
            edits["mounts"] = list(edits.get("mounts") or [])
            edits["env"] = list(edits.get("env") or [])
            return edits
    return None


def device_cgroup_problem(found: dict[str, Any]) -> str:
    """Why the devices cgroup (v1) the agent and its slots run in refuses the GPU nodes,
    or ``""``. The slots get no devices cgroup of their own: they inherit this one,
    whose rules no child can widen. cgroup v2 device rules are eBPF programs, not
    readable here: ``""`` (the open in the slot says so if they refuse)."""
    try:
        own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.split(":")[1] == "devices")
        text = Path("/sys/fs/cgroup/devices", own.lstrip("/"), "devices.list").read_text()
    except (OSError, StopIteration, IndexError):
        return ""
    allowed = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and "r" in parts[2] and "w" in parts[2]:
            allowed.add((parts[0], parts[1]))
    if ("a", "*:*") in allowed:
        return ""
    root = found["root"]
    for g in found["gpus"]:
        st = os.stat(os.path.join(root, "dev", f"nvidia{g['minor']}"))
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        if not ({("c", f"{major}:{minor}"), ("c", f"{major}:*"), ("a", "*:*")} & allowed):
            return (f"the devices cgroup {own} does not allow c {major}:{minor} "
                    f"(/dev/nvidia{g['minor']}): its devices.list is {text.strip()!r}")
    return ""


class LocalGpus:
    """Which of the host's GPUs each local sandbox of a ``gpu`` profile gets.

    Sandboxes of a profile take GPUs round-robin among those of its type (a profile of
    ``"T4:1"`` on a host with two T4 puts its first sandbox on one, its second on the
    other); the slots of one sandbox share its GPUs.
    """

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def init_for(self, config: Any, image_root: str | None) -> dict[str, Any] | None:
        """The agent's ``init["gpu"]`` for a sandbox of ``config``, or None (no ``gpu``,
        or ``HERMES_MODAL_TOOL_GPU=ignore``).

        Raises:
            GpuUnavailableError: no NVIDIA GPU (names the profile and what it asked).
            GpuMismatchError: GPUs, but none (or too few) of the type asked.
        """
        if not config.gpu:
            return None
        request = parse_gpu(config.gpu)
        if gpu_mode() == "ignore":
            if config.name not in _warned:
                _warned.add(config.name)
                log.warning("profile %r: gpu %r ignored (%s=ignore): its slots run without a GPU",
                            config.name, config.gpu, GPU_MODE_ENV)
            return None
        root = discovery_root()
        found = agent_gpu.discover(root, read_cdi(root))
        start = self._next.get(config.name, 0)
        minors, problem = agent_gpu.select(found, request.type, request.count, start * request.count)
        hint = f" (set {GPU_MODE_ENV}=ignore to run its slots without a GPU)"
        if minors is None:
            cls = GpuMismatchError if found["gpus"] else GpuUnavailableError
            raise cls(f"profile {config.name!r}: gpu {config.gpu!r}: {problem}{hint}")
        why = device_cgroup_problem(found) if root == "/" else ""
        if why:
            raise GpuUnavailableError(f"profile {config.name!r}: gpu {config.gpu!r}: {why}")
        self._next[config.name] = start + 1
        mps = {"threads": config.gpu_mps_threads, "memory_mb": config.gpu_mps_memory}
        return {"found": found, "root": root, "type": request.type, "count": request.count,
                "minors": minors, "sharing": config.gpu_sharing, "mps": mps,
                "profile": config.name, "image": image_root is not None}


def container_init(config: Any) -> dict[str, Any] | None:
    """The agent's ``init["gpu"]`` for a Modal sandbox of ``config`` (None: no ``gpu``,
    or ``HERMES_MODAL_TOOL_GPU=ignore``). Modal gave the container the GPUs it asked
    for: the agent finds them there (every one of them, of whatever type) and gives
    them to the slots as locally; a container without one fails to start with
    :class:`~hermes_modal_tool.errors.GpuUnavailableError`."""
    if not config.gpu or gpu_mode() == "ignore":
        return None
    request = parse_gpu(config.gpu)
    return {"found": None, "root": "/", "type": None, "count": request.count, "minors": None,
            "sharing": config.gpu_sharing, "profile": config.name,
            "mps": {"threads": config.gpu_mps_threads, "memory_mb": config.gpu_mps_memory}}


class _Sampler:
    """The GPUs' compute processes (pid, MiB), sampled off the event loop: ``sample()``
    returns the last sample and its age at once and starts a new one in a thread when
    it is older than ``every`` seconds (NVML through ``nvidia-ml-py`` when installed,
    else ``nvidia-smi --query-compute-apps``, bounded by 5 s)."""

    def __init__(self, every: float = 2.0) -> None:
        self.every = every
        self._lock = threading.Lock()
        self._last: tuple[float, list[tuple[int, int]] | None, str] = (0.0, None, "not sampled yet")
        self._thread: threading.Thread | None = None

    def sample(self) -> tuple[float | None, list[tuple[int, int]] | None, str]:
        with self._lock:
            at, procs, note = self._last
            if time.monotonic() - at > self.every and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="hermes-modal-tool gpu sampler")
                self._thread.start()
        return (round(time.monotonic() - at, 1) if at else None), procs, note

    def _run(self) -> None:
        procs, note = _compute_apps()
        with self._lock:
            self._last = (time.monotonic(), procs, note)


def _compute_apps() -> tuple[list[tuple[int, int]] | None, str]:
    """``([(pid, used MiB)], how)`` of every compute process on the host's GPUs: those of
    :func:`discovery_root` (NVML reads the real driver, so not for a stand-in tree)."""
    try:
        if discovery_root() != "/":
            raise LookupError("a stand-in GPU root: its nvidia-smi, not this host's NVML")
        import pynvml  # the nvidia-ml-py package (optional extra "gpu")

        pynvml.nvmlInit()
        try:
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    out.append((int(p.pid), int((p.usedGpuMemory or 0) // (1024 * 1024))))
            return out, "nvml"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - not installed, or no driver: try nvidia-smi
        pass
    root = discovery_root()
    smi = next((os.path.join(root, b) for b in agent_gpu.discover(root)["bins"]
                if b.endswith("/nvidia-smi")), None)
    if smi is None:
        return None, "neither nvidia-ml-py nor nvidia-smi is available"
    try:
        res = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{smi}: {exc}"
    out = []
    for line in res.stdout.decode("utf-8", "replace").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            out.append((int(parts[0]), int(parts[1]) if parts[1].isdigit() else 0))
    return out, "nvidia-smi"


SAMPLER = _Sampler()
_SLOT_CGROUP = re.compile(r"/hermes-modal-tool/([^/]+)/slot_(\d+)$")


def _slot_of(pid: int) -> tuple[str, int] | None:
    """``(sandbox cgroup name, slot index)`` of a host process, from the kernel's
    ``/proc/<pid>/cgroup`` (never from anything a slot prints)."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        m = _SLOT_CGROUP.search(line.split(":", 2)[-1])
        if m:
            return m.group(1), int(m.group(2))
    return None


def gpu_status(config: Any, sandboxes: dict[str, Any]) -> dict[str, Any] | None:
    """The ``gpu`` entry of a pool's status: per sandbox the GPUs given, the sharing
    mode and, for the local driver, per slot the GPU processes and their memory (MiB).
    None when the profile has no ``gpu``. Never blocks: the processes are the last
    sample of a sampler thread (``sampled_s_ago``)."""
    if not config.gpu:
        return None
    per: dict[str, Any] = {}
    procs = note = age = None
    for sid, sb in sandboxes.items():
        given = (sb.info or {}).get("gpu")
        entry: dict[str, Any] = dict(given) if given else {"gpus": [], "sharing": None,
                                                           "note": f"{GPU_MODE_ENV}=ignore"}
        if given and config.driver == "local":
            if procs is None and note is None:
                age, procs, note = SAMPLER.sample()
            slots: dict[int, list[dict[str, int]]] = {}
            for pid, mib in procs or ():
                where = _slot_of(pid)
                if where and where[0] == given.get("cgroup"):
                    slots.setdefault(where[1], []).append({"pid": pid, "used_memory_mib": mib})
            entry["slots"] = slots
            entry["processes_from"] = note
            entry["sampled_s_ago"] = age
        elif given:
            entry["slots"] = None
            entry["processes_from"] = "not visible from the host (inside the Modal container)"
        per[sid] = entry
    return {"gpu": config.gpu, "sharing": config.gpu_sharing, "sandboxes": per}
