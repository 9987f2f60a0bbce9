"""The Modal driver: each sandbox is a Modal Sandbox running the agent in one long exec.

Needs the ``modal`` extra (``pip install 'hermes-modal-tool[modal]'``, SDK 1.6).
Every SDK call is an async ``.aio`` call. Per sandbox:

1. ``modal.Sandbox.create`` (rate-limited, capped starts, tagged with this package,
   the app, the profile and the owning process; a failed create is checked by tag
   before it is retried, so a retry never makes a duplicate);
2. one ``sandbox.exec("sh", "-c", ...)`` that starts the agent with the image's
   ``python3`` and receives its code over stdin (no image change needed);
3. that exec's stdin (one ``TaskExecStdinWriteStream`` held open) and stdout (one
   ``TaskExecStdioRead`` stream) carry the protocol: after warm-up a command is one
   message each way and no new RPC.

Inside the container each slot runs as its own uid (200000 + slot) with a 0700
workspace and its own process group, and in bubblewrap when the image has a
working ``bwrap`` (see SECURITY.md for what that does and does not isolate).

When Modal ends a sandbox (timeout, idle timeout, out of memory, preemption,
``modal sandbox terminate``), its stream closes; the handle asks Modal why and the
pool fails the sandbox's in-flight calls with that reason and replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

import modal
from modal import exception as mexc

from .. import agent, modal_network
from ..config import SandboxConfig
from ..errors import CredentialsError, SandboxStartError, SecretNotFoundError
from ..gpus import container_init
from ..secrets import secret_dirs
from ..volumes import agent_config
from . import _modal_sdk
from ._modal_handle import ModalHandle
from ._modal_volumes import modal_volumes
from .base import Driver, SandboxHandle

log = logging.getLogger("hermes_modal_tool")

PACKAGE_TAG = "hermes-modal-tool"  # every sandbox we create carries this tag
TAG_APP, TAG_PROFILE, TAG_SANDBOX = "hmt-app", "hmt-profile", "hmt-sandbox"
TAG_OWNER, TAG_HOST, TAG_PID, TAG_PID_START, TAG_BOOT = (
    "hmt-owner", "hmt-host", "hmt-pid", "hmt-pid-start", "hmt-boot")
TAG_CREATE = "hmt-create"  # one value per create attempt: finds a create that did happen
UID_BASE = 200000
PYTHON_ADD_DEFAULT = "3.11"
# Images whose name says they ship Python: used as they are under add_python: auto.
PYTHON_IMAGE_HINTS = ("python", "pytorch", "tensorflow", "jupyter", "conda", "mamba", "vllm",
                      "huggingface", "sagemath", "anaconda")
# Finds the image's Python and runs the agent's bootstrap with it ($1).
AGENT_SH = ('for p in python3 python; do if command -v "$p" >/dev/null 2>&1; then '
            'exec "$p" -I -S -c "$1"; fi; done; '
            'echo "hermes-modal-tool: no python3 or python in this image" >&2; exit 127')
#: The sandbox's entrypoint (PID 1): it ends the sandbox when the agent has not marked
#: the heartbeat file for ``$1`` seconds (the agent marks it while it hears from the owner).
#: The file is root's, in a 0700 directory: a slot can neither refresh nor remove it.
WATCHDOG_SH = ('d=/tmp/.hermes-modal-tool-beat; mkdir -p -m 700 "$d"; f="$d/beat"; touch "$f"; '
               'while sleep 2; do '
               'age=$(( $(date +%s) - $(stat -c %Y "$f" 2>/dev/null || echo 0) )); '
               'if [ "$age" -gt "$1" ]; then '
               'echo "hermes-modal-tool: no heartbeat from the owner for ${age} s (heartbeat_timeout '
               '$1 s): ending the sandbox" >&2; exit 0; fi; done')
HEARTBEAT_FILE = "/tmp/.hermes-modal-tool-beat/beat"
_RETRYABLE = (mexc.ResourceExhaustedError, mexc.ServiceError, mexc.InternalError,
              mexc.ConnectionError, mexc.TimeoutError, ConnectionError, OSError)


def owner_tags() -> dict[str, str]:
    """Tags that identify this process, so ``modal gc`` can tell when it is gone."""
    return {TAG_HOST: socket.gethostname()[:60], TAG_PID: str(os.getpid()),
            TAG_PID_START: str(_process_start(os.getpid()) or 0), TAG_BOOT: _boot_id()}


def _process_start(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()[:8]
    except OSError:
        return ""


def owner_alive(tags: dict[str, str]) -> bool | None:
    """Is the process that created a sandbox (by its tags) still running?

    Returns None when that cannot be known from here (another host).
    """
    if tags.get(TAG_HOST) != socket.gethostname()[:60] or tags.get(TAG_BOOT, "") != _boot_id():
        return None if tags.get(TAG_HOST) != socket.gethostname()[:60] else False
    try:
        pid = int(tags.get(TAG_PID, ""))
    except ValueError:
        return False
    start = _process_start(pid)
    return start is not None and str(start) == tags.get(TAG_PID_START)


def credential_source() -> str:
    """Where the Modal SDK reads credentials from here, for error messages (no secrets)."""
    from modal.config import _profile, config, user_config_path

    if os.environ.get("MODAL_TOKEN_ID") or os.environ.get("MODAL_TOKEN_SECRET"):
        return "the MODAL_TOKEN_ID and MODAL_TOKEN_SECRET environment variables"
    if config.get("token_id"):
        return f"profile {_profile!r} in {user_config_path}"
    return (f"nothing: no MODAL_TOKEN_ID/MODAL_TOKEN_SECRET variables and no token in profile "
            f"{_profile!r} of {user_config_path}")


def python_to_add(config: SandboxConfig) -> str | None:
    """The Python version to add to the profile's image, or None to use it as it is."""
    choice = config.add_python
    if choice == "no":
        return None
    if choice != "auto":
        return choice
    name = config.image.lower().rsplit("/", 1)[-1]
    return None if any(h in name for h in PYTHON_IMAGE_HINTS) else PYTHON_ADD_DEFAULT


def translate_error(exc: BaseException, config: SandboxConfig, doing: str) -> Exception:
    """Turn a Modal SDK error into this package's error, saying what to do."""
    where = f"profile {config.name!r}: {doing}"
    text = str(exc) or type(exc).__name__
    if isinstance(exc, mexc.AuthError):
        return CredentialsError(f"{where}: Modal rejected the credentials read from "
                                f"{credential_source()} ({text}). Run 'modal token new' or set "
                                "MODAL_TOKEN_ID and MODAL_TOKEN_SECRET")
    if isinstance(exc, mexc.NotFoundError) and "ecret" in text:
        return SecretNotFoundError(
            f"{where}: {text}. The profile's secrets {config.secrets} must exist in the Modal "
            "environment: create one with 'modal secret create NAME KEY=VALUE'")
    if isinstance(exc, mexc.ResourceExhaustedError):
        return SandboxStartError(
            f"{where}: Modal refused to create more sandboxes ({text}). Check the workspace's "
            "sandbox quota, or lower max_sandboxes or the driver's create_rate")
    if isinstance(exc, (mexc.RemoteError, mexc.ExecutionError)) or "build" in text.lower():
        return SandboxStartError(
            f"{where}: image {config.image!r} could not be built or pulled ({text}). Check that "
            "the tag exists and is public (or add registry credentials), and add_python")
    return SandboxStartError(f"{where}: {type(exc).__name__}: {text}")


class _RateLimiter:
    """At most ``rate`` acquisitions per second, spaced evenly (first one immediate)."""

    def __init__(self, rate: float) -> None:
        self.interval = 1.0 / rate
        self.next = 0.0

    async def wait(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        at = max(now, self.next)
        self.next = at + self.interval
        if at > now:
            await asyncio.sleep(at - now)


class ModalDriver(Driver):
    """Starts sandboxes on Modal (or the local control plane in ``testing.modal_server``).

    Args:
        create_rate: sandbox creations per second at most (Modal limits the create
            rate per workspace); default 20.
        max_starting: sandboxes starting at once at most (start-up congestion); default 16.
        client: a ``modal.Client`` to use; by default one is made from the SDK's
            config (``MODAL_TOKEN_ID``/``MODAL_TOKEN_SECRET`` or ``~/.modal.toml``)
            and closed by :meth:`aclose`.

    Raises:
        ConfigError: a bad option.
    """

    name = "modal"

    def __init__(self, *, create_rate: float = 20.0, max_starting: int = 16,
                 client: Any = None) -> None:
        from ..errors import ConfigError

        if not isinstance(create_rate, (int, float)) or not create_rate > 0:
            raise ConfigError(f"modal driver option create_rate must be > 0 per second, got {create_rate!r}")
        if not isinstance(max_starting, int) or max_starting < 1:
            raise ConfigError(f"modal driver option max_starting must be an integer >= 1, got {max_starting!r}")
        self.create_rate = float(create_rate)
        self.max_starting = max_starting
        self._client = client
        self._own_client = client is None
        self._client_lock: asyncio.Lock | None = None
        self._limiter = _RateLimiter(self.create_rate)
        self._starting: asyncio.Semaphore | None = None
        self._apps: dict[str, Any] = {}
        self._images: dict[tuple[str, str | None], Any] = {}
        self._live: dict[str, Any] = {}  # modal object id -> Sandbox we created and not yet ended
        self.owner = uuid.uuid4().hex[:12]
        self.stats = {"created": 0, "create_retries": 0, "adopted_after_error": 0}
        self._networks: dict[str, dict[str, Any]] = {}  # profile -> modal_network.describe

    async def _get_client(self, config: SandboxConfig) -> Any:
        if self._client_lock is None:
            self._client_lock = asyncio.Lock()
        async with self._client_lock:
            if self._client is None:
                from modal.config import config as modal_config

                token_id, token_secret = modal_config.get("token_id"), modal_config.get("token_secret")
                if not token_id or not token_secret:
                    raise CredentialsError(
                        f"profile {config.name!r}: no Modal credentials: read {credential_source()}. "
                        "Run 'modal token new' or set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET")
                try:
                    client = await modal.Client.from_credentials.aio(token_id, token_secret)
                    await client.hello.aio()
                except Exception as exc:
                    raise translate_error(exc, config, "connecting to Modal") from None
                self._client = client
        return self._client

    async def _app(self, config: SandboxConfig, client: Any) -> Any:
        name = config.get_app_name()
        app = self._apps.get(name)
        if app is None:
            try:
                app = await modal.App.lookup.aio(name, create_if_missing=True, client=client)
            except Exception as exc:
                raise translate_error(exc, config, f"looking up app {name!r}") from None
            self._apps[name] = app
        return app

    def _image(self, config: SandboxConfig) -> Any:
        key = (config.image, python_to_add(config))
        image = self._images.get(key)
        if image is None and config.image.startswith("im-"):  # an image id (snapshot_sandbox)
            image = self._images[key] = modal.Image.from_id(config.image)
        elif image is None:
            from ..images.sources import modal_unsupported

            modal_unsupported(config.image, config.name)  # local sources: a clear error
            image = self._images[key] = modal.Image.from_registry(config.image, add_python=key[1])
        return image

    def tags(self, config: SandboxConfig, sandbox_id: str) -> dict[str, str]:
        """The tags a new sandbox of ``config`` gets (see :data:`PACKAGE_TAG`)."""
        return {PACKAGE_TAG: "1", TAG_APP: config.get_app_name()[:60], TAG_PROFILE: config.name[:60],
                TAG_SANDBOX: sandbox_id[:60], TAG_OWNER: self.owner, **owner_tags(),
                TAG_CREATE: uuid.uuid4().hex}

    async def _create(self, config: SandboxConfig, sandbox_id: str) -> Any:
        """Create one sandbox: rate-limited; after an error that may hide a success,
        look for it by its create tag before trying again (bounded)."""
        client = await self._get_client(config)
        app = await self._app(config, client)
        image = self._image(config)
        secrets = [modal.Secret.from_name(n) for n in config.secrets]
        volumes = await modal_volumes(config, client, translate_error) if config.volumes else {}
        tags = self.tags(config, sandbox_id)
        self._networks[config.name] = modal_network.describe(config)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 90.0
        delay = 0.5
        while True:
            await self._limiter.wait()
            try:
                sb = await modal.Sandbox.create.aio(
                    "sh", "-c", WATCHDOG_SH, "hermes-modal-tool-watchdog",
                    str(int(config.heartbeat_timeout)), app=app, image=image, secrets=secrets, env=dict(config.env_vars) or None,
                    cpu=config.cpu, memory=config.memory, gpu=config.gpu,
                    timeout=max(1, int(config.max_lifetime)),
                    idle_timeout=max(1, int(config.idle_timeout)),
                    tags=tags, volumes=volumes, client=client, **modal_network.create_kwargs(config))
            except _RETRYABLE as exc:
                found = await self._find_created(app, client, tags[TAG_CREATE])
                if found is not None:
                    self.stats["adopted_after_error"] += 1
                    return found
                if loop.time() + delay > deadline:
                    raise translate_error(exc, config, "creating a sandbox") from None
                self.stats["create_retries"] += 1
                log.warning("profile %r: Modal did not create a sandbox (%s: %s); no sandbox has "
                            "its tag, retrying in %.1f s", config.name, type(exc).__name__, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
            except Exception as exc:
                raise translate_error(exc, config, "creating a sandbox") from None
            else:
                self.stats["created"] += 1
                return sb

    async def _find_created(self, app: Any, client: Any, key: str) -> Any | None:
        """The sandbox a failed create call made after all (by its create tag), if any.

        If retries inside the SDK made several, the others are terminated.
        """
        found: list[Any] = []
        with contextlib.suppress(Exception):
            async for sb in modal.Sandbox.list.aio(app_id=app.app_id, tags={TAG_CREATE: key},
                                                   client=client):
                found.append(sb)
        for extra in found[1:]:
            with contextlib.suppress(Exception):
                await extra.terminate.aio()
        return found[0] if found else None

    async def start_sandbox(self, config: SandboxConfig, sandbox_id: str) -> tuple[SandboxHandle, dict[str, Any]]:
        if self._starting is None:
            self._starting = asyncio.Semaphore(self.max_starting)
        async with self._starting:
            sb = await self._create(config, sandbox_id)
            self._live[sb.object_id] = sb
            try:
                process = await sb.exec.aio("sh", "-c", AGENT_SH, "hermes-modal-tool-agent",
                                            agent.BOOTSTRAP, text=False)
            except BaseException as exc:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(sb.terminate.aio(), 30)
                    self._live.pop(sb.object_id, None)
                if isinstance(exc, Exception):
                    raise translate_error(exc, config, "starting the agent") from None
                raise
        pipe = _modal_sdk.StdinPipe()
        pipe.write(agent.bundle(compiled=False))  # source: the image's Python version may differ
        handle = ModalHandle(self, config, sandbox_id, sb, process, pipe)
        state = f"/tmp/.hermes-modal-tool/{sandbox_id}"
        base = config.workspace_base
        init = {
            "sandbox_id": sandbox_id,
            "cgroup_name": f"hmt-{sandbox_id}",
            "workspace_base": base,
            "host_root": base,
            "state_dir": state,
            "ctl_root": None,
            "slots": config.slots_per_sandbox,
            "isolation": config.isolation,
            "bwrap": "auto",
            # egress is Modal's to enforce, per sandbox (modal_network.py): the slots
            # share the container's network.
            "network": "host" if config.network == "egress" else config.network,
            "env": {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "dumb", **config.env_vars},
            "inherit_env": True,
            "uid_base": UID_BASE if config.isolation == "bwrap" else None,
            "limits": {"memory_mb": config.memory, "slot_memory_mb": config.slot_memory_mb,
                       "pids": config.pids_limit, "cpu": config.cpu,
                       "processes": config.slot_processes,
                       "process_output_mb": config.slot_process_output},
            "output_limit": config.output_limit,
            # The host's secrets directories: absent from a real image, but where an image
            # has the path (one made from this machine, the local control plane's host
            # root) its slots must not see it (whited out, or behind a tmpfs).
            "hide": [str(d) for d in secret_dirs()],
            "cgroups": True,
            "workdir": config.workdir,
            "filesystem": config.filesystem,
            "slot_disk": config.slot_disk,
            "disk_limit": config.disk_limit,
            "heartbeat": {"file": HEARTBEAT_FILE, "every": config.heartbeat_timeout / 6},
            "gpu": container_init(config),  # the container's GPUs, found by the agent
            "volumes": agent_config(config.volumes),  # Modal Volumes, mounted at their targets
        }
        return handle, init

    def describe(self) -> dict[str, Any]:
        return {"driver": self.name, "create_rate": self.create_rate, "max_starting": self.max_starting,
                "live_sandboxes": len(self._live), "owner": self.owner, **self.stats,
                "network": dict(self._networks)}

    async def aclose(self) -> None:
        """Terminate every sandbox this driver created that is still running; close the client."""
        live, self._live = list(self._live.values()), {}
        if live:
            results = await asyncio.gather(
                *(asyncio.wait_for(sb.terminate.aio(), 30) for sb in live), return_exceptions=True)
            for sb, res in zip(live, results, strict=True):
                if isinstance(res, BaseException):
                    log.warning("could not terminate Modal sandbox %s: %s", sb.object_id, res)
        if self._own_client and self._client is not None:
            client, self._client = self._client, None
            with contextlib.suppress(Exception):
                await client.close.aio()


@dataclass
class Orphan:
    """A sandbox tagged by this package, and what ``modal gc`` decided about it."""

    sandbox_id: str
    app: str
    profile: str
    owner: str
    owner_alive: bool | None
    terminated: bool = False
    error: str = ""


async def collect_orphans(*, app_name: str | None = None, terminate: bool = True,
                          include_unknown: bool = False, client: Any = None) -> list[Orphan]:
    """Find (and terminate) sandboxes tagged by this package whose owner is gone.

    The owner is the process named by the sandbox's tags (host, pid and its start
    time). On another host it cannot be checked: such sandboxes are listed with
    ``owner_alive=None`` and terminated only with ``include_unknown=True``.

    Args:
        app_name: only sandboxes of this Modal app (else every app in the environment).
        terminate: terminate the orphans (False: only list them).
        include_unknown: also terminate sandboxes whose owner cannot be checked.
        client: a ``modal.Client`` (default: from the SDK's config).

    Raises:
        CredentialsError: Modal rejected or found no credentials.
    """
    cfg = SandboxConfig(name="gc")
    if client is None:
        driver = ModalDriver()
        client = await driver._get_client(cfg)
    else:
        driver = None
    try:
        found: list[tuple[Any, dict[str, str]]] = []
        try:
            if app_name:
                try:
                    app_ids = [(await modal.App.lookup.aio(app_name, client=client)).app_id]
                except mexc.NotFoundError:
                    return []
            else:
                from modal.config import config as modal_config

                env = modal.Environment.from_name(modal_config.get("environment") or "main",
                                                  client=client)
                app_ids = [app.app_id for app in await env.apps.list.aio()]
            for app_id in app_ids:
                async for sb in modal.Sandbox.list.aio(app_id=app_id, tags={PACKAGE_TAG: "1"},
                                                       client=client):
                    found.append((sb, await sb.get_tags.aio()))
        except Exception as exc:
            raise translate_error(exc, cfg, "listing sandboxes") from None
        out = []
        for sb, tags in found:
            alive = owner_alive(tags)
            owner = f"{tags.get(TAG_HOST, '?')} pid {tags.get(TAG_PID, '?')}"
            orphan = Orphan(sb.object_id, tags.get(TAG_APP, ""), tags.get(TAG_PROFILE, ""), owner, alive)
            if alive is True:
                continue
            if terminate and (alive is False or include_unknown):
                try:
                    await sb.terminate.aio()
                    orphan.terminated = True
                except Exception as exc:
                    orphan.error = f"{type(exc).__name__}: {exc}"
            out.append(orphan)
        return out
    finally:
        if driver is not None:
            await driver.aclose()

