"""The Hermes terminal tool: ``terminal_tool(command, ...) -> JSON string``, one slot per task.

A drop-in for the original ``tools.terminal_tool`` (code ports by changing the
import). Every ``task_id`` gets its own slot (a private workspace and a
persistent bash session, so ``cd``/``export`` stick) that it keeps until
:func:`cleanup_vm`, :func:`cleanup_all_environments`, or until it has been idle
for ``TERMINAL_LIFETIME_SECONDS``. The calls run on the process's one background
event-loop thread (:mod:`hermes_modal_tool.portal`), so ``terminal_tool`` works
from plain sync code, from many threads at once, and from inside a running event
loop (it blocks the calling thread until the command is done).

Example::

    from hermes_modal_tool.adapters.hermes import terminal_tool, cleanup_vm

    terminal_tool("mkdir proj && cd proj", task_id="my-task")
    terminal_tool("pwd", task_id="my-task")   # {"output": ".../proj\\n", "exit_code": 0, "error": null}
    terminal_tool("sleep 9", timeout=1, task_id="my-task")   # exit_code 124
    cleanup_vm("my-task")

Environment (read when the process-wide manager is first built, and again after
:func:`cleanup_all_environments`); the README's "Porting from the original"
section lists every variable:

- ``TERMINAL_ENV``: ``local`` (default; bubblewrap sandboxes on this machine) or
  ``modal`` (the ``modal`` driver: Modal sandboxes, with the Modal SDK's credentials;
  ``MODAL_SERVER_URL`` may point at ``hermes_modal_tool.testing.modal_server``).
  The original's ``slot_pool`` (with ``TERMINAL_SLOT_BACKEND`` ``modal`` or unset)
  is ``modal``.
- ``TERMINAL_MODAL_PROFILES_FILE``: a ``modal_profiles.yaml`` (default:
  ``./modal_profiles.yaml`` when it exists); ``profile=`` picks one of its profiles.
  ``TERMINAL_MODAL_DEFAULT_PROFILE`` names the default one. ``TERMINAL_MODAL_IMAGE``,
  ``TERMINAL_MODAL_SLOTS``, ``TERMINAL_MODAL_MIN``/``MAX`` and every other
  ``TERMINAL_MODAL_{KEY}`` set that key for every profile,
  ``TERMINAL_MODAL_PROFILE_{name}_{KEY}`` for one (see
  :mod:`hermes_modal_tool.profiles` and :class:`ModalProfile`).
- ``TERMINAL_MODAL_APP_NAME``: the Modal app name of every profile (default
  ``hermes-terminal-{profile}``); for ``slot_pool``, ``TERMINAL_SLOT_APP_NAME``
  (default ``hermes-slot-pool``) and ``TERMINAL_DOCKER_IMAGE`` (the image when
  ``TERMINAL_MODAL_IMAGE`` is unset), as the original's slot pool read them.
- ``TERMINAL_TIMEOUT``: default seconds per command (else the profile's
  ``execution_timeout_s``, 60 s unless configured, as in the original).
- ``TERMINAL_CWD``: the directory the shell starts in, inside each slot (the
  profiles' ``workdir``; default ``/workspace``).
- ``TERMINAL_LIFETIME_SECONDS``: release a task's slot after this many idle
  seconds (default 300; ``0`` never).

``force``: in the original, ``force=True`` skips Hermes's dangerous-command
approval. The original skips that check anyway for isolated backends (Modal,
Docker, Singularity), and every command here runs in an isolated slot, so
``force`` is accepted and has no effect.

Failures never raise: they come back as ``{"output": "", "exit_code": -1,
"error": "..."}``. A timed-out command (``exit_code`` 124) keeps the output it
printed, its processes are killed, and it is never retried.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib.util
import json
import logging
import os
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..backend import ToolBackend
from ..config import ModalSandboxConfig, SandboxConfig
from ..errors import ConfigError, HermesModalToolError, IsolationUnavailableError, install_hint
from ..portal import run_sync
from ..sessions import SlotSessions
from ..slots import ExecutionResult, SlotState
from ..tools import TOOL_SPECS
from .hermes_profiles import (  # noqa: F401
    HERMES_OWN_VARS,
    ModalProfile,
    terminal_profiles,
    warn_no_effect,
)

__all__ = [
    "DEFAULT_TASK_ID",
    "YAML_AVAILABLE",
    "ModalProfile",
    "TERMINAL_TOOL_DESCRIPTION",
    "check_terminal_requirements",
    "cleanup_all_environments",
    "cleanup_vm",
    "get_active_environments_info",
    "run_terminal_call",
    "terminal_tool",
]

#: The original terminal tool's flag for "PyYAML is importable, so modal_profiles.yaml can be
#: read" (it fell back to environment variables without it). PyYAML is a dependency here,
#: so it is always True; code that imports or checks it keeps working.
YAML_AVAILABLE = importlib.util.find_spec("yaml") is not None

log = logging.getLogger("hermes_modal_tool")

#: What the model reads (the ``bash`` contract every adapter shares).
TERMINAL_TOOL_DESCRIPTION: str = TOOL_SPECS["bash"].description
#: The task a call without ``task_id`` runs in.
DEFAULT_TASK_ID = "default"
DEFAULT_LIFETIME_S = 300.0
ENV_TYPES = ("local", "modal")
#: The original's TERMINAL_ENV value for its slot pool: Modal here.
SLOT_POOL = "slot_pool"


def terminal_tool(command: str, background: bool = False, timeout: float | None = None,
                  task_id: str | None = None, force: bool = False, profile: str | None = None) -> str:
    """Run ``command`` in ``task_id``'s slot and return a JSON string.

    Args:
        command: a bash command line; runs in the task's persistent shell.
        background: start it in the background and return at once (its output goes
            to a log file in the workspace, named in ``output``).
        timeout: seconds before the command is stopped (exit code 124); default
            ``TERMINAL_TIMEOUT``, else the profile's ``execution_timeout_s`` (60 s unless configured).
        task_id: whose slot (default ``"default"``); a new id gets a new, empty slot.
        force: accepted for compatibility; no effect (see the module docstring).
        profile: a profile of ``TERMINAL_MODAL_PROFILES_FILE`` (default: its
            ``default_profile``). A task that asks for another profile than the one
            its slot came from gets a new slot.

    Returns:
        ``{"output": str, "exit_code": int, "error": str | None}`` as JSON.
        ``exit_code`` is the command's, 124 on timeout, -1 when it could not run
        (then ``error`` says why: a bad argument, an unknown profile, a driver
        that is not installed, ...).
    """
    del force  # every command runs in an isolated slot; see the module docstring
    return run_terminal_call({"command": command, "background": background, "timeout": timeout},
                             task_id=task_id, profile=profile)


def run_terminal_call(args: Mapping[str, Any], task_id: str | None = None,
                      profile: str | None = None) -> str:
    """Run one model tool call (``command``, ``timeout``, ``background``, ``stdin``)
    in ``task_id``'s slot; the JSON string :func:`terminal_tool` returns.

    The arguments are checked against ``TOOL_SPECS["bash"]``; the Hermes plugin's
    handler calls this with the model's arguments.
    """
    if not isinstance(args, Mapping):
        return _error(f"expected the arguments as an object, got {type(args).__name__}")
    try:
        call = TOOL_SPECS["bash"].engine_args(dict(args))
    except ValidationError as exc:
        return _error("invalid arguments: " + _describe(exc))
    if task_id is not None and not isinstance(task_id, str):
        return _error(f"task_id must be a string, got {type(task_id).__name__}")
    try:
        result = run_sync(_manager().execute(task_id or DEFAULT_TASK_ID, call, profile))
    except HermesModalToolError as exc:
        hint = ""
        if _current is not None and _current.env_type == "modal" and (
                "driver 'modal'" in str(exc) or "Modal credentials" in str(exc)):
            hint = " (TERMINAL_ENV=modal selects Modal; TERMINAL_ENV=local runs the sandboxes on this machine)"
        return _error(f"{exc}{hint}")
    except Exception as exc:  # the agent loop gets a result, never an exception
        log.exception("terminal_tool failed")
        return _error(f"{type(exc).__name__}: {exc}")
    return _to_json(result)


def cleanup_vm(task_id: str) -> bool:
    """Release ``task_id``'s slot: its workspace is emptied and its shell ended
    (the next call with this id gets a fresh slot). Returns whether it had one."""
    manager = _current
    if manager is None:
        return False
    try:
        return run_sync(manager.sessions.close(task_id or DEFAULT_TASK_ID))
    except Exception as exc:
        log.warning("cleanup_vm(%r) failed: %s", task_id, exc)
        return False


def cleanup_all_environments() -> int:
    """Release every task's slot and stop the backend (all its sandboxes).

    The next ``terminal_tool`` call builds a new backend, reading the environment
    again. Also runs at interpreter exit. Returns how many tasks held a slot.
    """
    global _current
    with _lock:
        manager, _current = _current, None
    if manager is None:
        return 0
    try:
        return run_sync(manager.aclose(), timeout=120)
    except Exception as exc:
        log.warning("cleanup_all_environments: stopping the backend failed: %s", exc)
        return 0


def get_active_environments_info() -> dict[str, Any]:
    """Which tasks hold slots: ``{"env_type", "count", "task_ids", "workdirs",
    "total_disk_usage_mb", "tasks", "sandboxes", "total_slots", "available_slots"}``.

    ``tasks`` maps each task id to its slot id, workspace, profile and idle seconds;
    ``workdirs`` maps it to the directory its shell started in (the profile's
    ``workdir``, else the workspace); ``total_disk_usage_mb`` is the MiB of files in
    the tasks' workspaces (a slot busy with a command is not measured).
    """
    manager = _current
    if manager is None:
        return {"env_type": _raw_env_type(), "count": 0, "task_ids": [], "workdirs": {},
                "total_disk_usage_mb": 0.0, "tasks": {}, "sandboxes": 0, "total_slots": 0,
                "available_slots": 0}
    return run_sync(manager.info())


def check_terminal_requirements() -> bool:
    """Whether commands can run: for ``TERMINAL_ENV=local``, bubblewrap is found
    and can create user namespaces (or the default profile has ``isolation:
    none``); for ``modal``, the modal driver is installed and Modal credentials
    exist (``MODAL_TOKEN_ID``, or a token in ``~/.modal.toml``, as the SDK reads
    them; they are not checked with Modal here)."""
    try:
        env_type = _env_type()
        if env_type == "modal":
            if (importlib.util.find_spec("modal") is None
                    or importlib.util.find_spec("hermes_modal_tool.drivers.modal") is None):
                log.warning("terminal requirements not met: the modal extra is not installed "
                            "(%s)", install_hint("modal"))
                return False
            if not _modal_credentials():
                log.warning("terminal requirements not met: no Modal credentials (set MODAL_TOKEN_ID "
                            "and MODAL_TOKEN_SECRET, or run `modal token new` for ~/.modal.toml)")
                return False
            return True
        profiles, default = terminal_profiles()
        if profiles[default].isolation == "none":
            return True
        return _isolation_works()
    except Exception as exc:
        log.warning("terminal requirements not met: %s", exc)
        return False


# -- the process-wide manager -----------------------------------------------------------

class _Manager:
    """One backend and its task -> slot map, built from the environment."""

    def __init__(self) -> None:
        self.env_type = _env_type()
        cls = ModalSandboxConfig if self.env_type == "modal" else SandboxConfig
        slot_pool: dict[str, Any] = {}
        if _raw_env_type() == SLOT_POOL:  # the original's slot pool read these
            slot_pool["app_name"] = os.environ.get("TERMINAL_SLOT_APP_NAME") or "hermes-slot-pool"
            if os.environ.get("TERMINAL_DOCKER_IMAGE"):
                slot_pool["image"] = os.environ["TERMINAL_DOCKER_IMAGE"]
        profiles, default = terminal_profiles(cls=cls, defaults=slot_pool)
        warn_no_effect(os.environ)
        self.backend = ToolBackend(profiles=profiles, default_profile=default, app_name="hermes-terminal")
        self.default_timeout = _env_seconds("TERMINAL_TIMEOUT", None)
        lifetime = _env_seconds("TERMINAL_LIFETIME_SECONDS", DEFAULT_LIFETIME_S, allow_zero=True)
        self.sessions = SlotSessions(self.backend, lifetime_s=lifetime or None)
        self._reaper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.sessions.lifetime_s is not None:
            self._reaper = asyncio.create_task(self._reap(self.sessions.lifetime_s),
                                               name="hermes-terminal-reaper")

    async def _reap(self, lifetime: float) -> None:
        # Idle tasks are also expired on every call; this covers a process that stops calling.
        while True:
            await asyncio.sleep(min(max(lifetime / 4, 1.0), 30.0))
            try:
                await self.sessions.expire_idle()
            except Exception as exc:
                log.warning("releasing idle terminal slots failed: %s", exc)

    async def execute(self, task_id: str, args: dict[str, Any], profile: str | None) -> ExecutionResult:
        if profile is not None:
            # Checked here: SlotSessions drops a task's slot before it learns the new
            # profile is unknown, and takes None -> "default" for a change of profile.
            if profile not in self.backend.profiles:
                raise ConfigError(f"unknown profile {profile!r}; known profiles: "
                                  f"{', '.join(self.backend.profiles)}")
            current = self.sessions.info().get(task_id) if task_id in self.sessions else None
            if current is not None and current["profile"] == profile:
                profile = None
        return await self.sessions.execute(task_id, "bash", args, timeout_s=self.default_timeout,
                                           profile=profile)

    async def info(self) -> dict[str, Any]:
        tasks = self.sessions.info()
        status = self.backend.get_status()
        workdirs = {t: self.backend.profiles[i["profile"]].workdir or i["workspace"]
                    for t, i in tasks.items()}
        return {"env_type": self.env_type, "count": len(tasks), "task_ids": sorted(tasks),
                "tasks": tasks, "workdirs": workdirs,
                "total_disk_usage_mb": await self._disk_usage_mb(),
                "sandboxes": status["sandboxes"], "total_slots": status["total_slots"],
                "available_slots": status["available_slots"]}

    async def _disk_usage_mb(self) -> float:
        """MiB of files in the tasks' workspaces and working directories (slots running a
        command are skipped: measuring them would wait for the command; up to 10000 files
        per directory)."""
        slots = [s for s in self.sessions.slots().values() if s.state is SlotState.ACQUIRED]
        requests = []
        for s in slots:
            workdir = self.backend.profiles[s.profile].workdir
            dirs = [s.workspace_dir]
            if workdir and not (workdir + "/").startswith(s.workspace_dir + "/") \
                    and not (s.workspace_dir + "/").startswith(workdir + "/"):
                dirs.append(workdir)
            requests += [(s, "list_files", {"path": d, "recursive": True, "max_entries": 10000})
                         for d in dirs]
        listings = await self.backend.execute_batch(requests, timeout_s=10)
        total = sum(e.get("size", 0) for r in listings if r.success
                    for e in r.metadata.get("entries", []) if e.get("type") == "file")
        return round(total / (1024 * 1024), 2)

    async def aclose(self) -> int:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        try:
            return await self.sessions.close_all()
        finally:
            await self.backend.stop()


_lock = threading.Lock()
_current: _Manager | None = None


def _manager() -> _Manager:
    global _current
    with _lock:
        if _current is None:
            manager = _Manager()
            run_sync(manager.start())
            _current = manager
        return _current


def _close_at_exit() -> None:
    try:
        cleanup_all_environments()
    except Exception:  # never fail interpreter shutdown
        pass


# Stopping sandboxes uses the loop's thread pool, which refuses work once threading
# shutdown has begun ("cannot schedule new futures after interpreter shutdown"), and
# plain atexit hooks run after that. So stop them from a threading exit hook, which
# runs before the pool's own (hooks run last-registered first; importing the pool
# module registers its hook now). atexit stays as the fallback (a no-op when done).
if hasattr(threading, "_register_atexit"):
    import concurrent.futures.thread  # noqa: F401

    threading._register_atexit(_close_at_exit)
atexit.register(_close_at_exit)


# -- helpers -------------------------------------------------------------------------------

def _raw_env_type() -> str:
    return (os.environ.get("TERMINAL_ENV") or "local").strip().lower()


def _env_type() -> str:
    value = _raw_env_type()
    if value == SLOT_POOL:
        backend = (os.environ.get("TERMINAL_SLOT_BACKEND") or "modal").strip().lower()
        if backend != "modal":
            raise ConfigError(f"environment variable TERMINAL_SLOT_BACKEND: {backend!r} is not "
                              "supported; the slot pool runs on Modal (modal) or, with "
                              "TERMINAL_ENV=local, on this machine")
        return "modal"
    if value not in ENV_TYPES:
        raise ConfigError(f"environment variable TERMINAL_ENV: {value!r} is not supported; use one of: "
                          f"{', '.join(ENV_TYPES)} (docker is a later driver)")
    return value


def _modal_credentials() -> bool:
    """Whether the Modal SDK finds a token (environment or the active ~/.modal.toml profile)."""
    if os.environ.get("MODAL_TOKEN_ID"):
        return True
    try:
        from modal.config import config as modal_config

        return bool(modal_config.get("token_id"))
    except Exception:  # an unreadable config file: look for the file, as the original did
        return Path(os.environ.get("MODAL_CONFIG_PATH") or Path.home() / ".modal.toml").is_file()


def _env_seconds(name: str, default: float | None, allow_zero: bool = False) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value > 0 or (allow_zero and value == 0)):
        raise ConfigError(f"environment variable {name}: expected a positive number of seconds, got {raw!r}")
    return value


_isolation_ok = False


def _isolation_works() -> bool:
    """Can bubblewrap create the namespaces slots need? (A positive answer is cached.)"""
    global _isolation_ok
    if _isolation_ok:
        return True
    from ..drivers.local import BASE_PATH, find_bwrap

    try:
        bwrap = find_bwrap()
    except IsolationUnavailableError as exc:
        log.warning("%s", exc)
        return False
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--ro-bind", "/", "/", "--proc", "/proc",
            "--dev", "/dev", "true"]
    # As root, slots run as unprivileged uids: probe as one, like the local driver does.
    as_nobody = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=10, env={"PATH": BASE_PATH}, **as_nobody)
    except PermissionError:  # bwrap not executable by that uid: the driver copies it; probe as root
        proc = subprocess.run(argv, capture_output=True, timeout=10, env={"PATH": BASE_PATH})
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("bubblewrap probe failed: %s", exc)
        return False
    if proc.returncode != 0:
        log.warning("bubblewrap cannot create the namespaces slots need: %s",
                    proc.stderr.decode(errors="replace").strip())
        return False
    _isolation_ok = True
    return True


def _to_json(result: ExecutionResult) -> str:
    rc = result.metadata.get("returncode")
    if result.metadata.get("timed_out"):
        exit_code = 124
    else:
        exit_code = rc if isinstance(rc, int) else -1
    error = result.error
    if error == f"exit code {rc}":  # a plain non-zero exit: the code says it all
        error = None
    return json.dumps({"output": result.output, "exit_code": exit_code, "error": error}, ensure_ascii=False)


def _error(message: str) -> str:
    return json.dumps({"output": "", "exit_code": -1, "error": message}, ensure_ascii=False)


def _describe(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'arguments'}: {err['msg']}"
                     for err in exc.errors())
