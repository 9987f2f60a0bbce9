"""The node side of the Ray driver: one Ray actor per sandbox, on the node Ray placed it.

The actor starts the sandbox with the local driver on its node (the agent as a process of
the actor, each slot in bubblewrap: the same isolation as ``driver: local``) and exposes
the agent's stdio as one TCP stream on the node's address. The host connects once and
sends the sandbox's secret token (:data:`TOKEN_BYTES` random bytes, given to the actor in
its ``start`` call) before any frame; a connection whose first bytes are not the token is
closed, and after the first good one the port is closed to everyone else. From then on
the actor only relays bytes: no Ray call per command.

Ends of a sandbox, on the node:

* the host closes the stream (``terminate``, or the host process died): the actor stops
  the agent (EOF on its stdin, then SIGKILL after 3 s) and removes its state;
* the agent exits: the actor closes the stream and keeps why (:meth:`SandboxActor.why`);
* the actor's owner (the host process) is gone: Ray kills the actor (owner semantics of
  a non-detached actor), the agent's stdin closes and it exits with its slots.

An actor killed at once (its owner gone, SIGKILL) cannot remove its two directories on
the node (``$TMPDIR/hermes-modal-tool-ray-PID-*`` and ``/dev/shm/hermes-modal-tool-ray-PID-*``;
its agent removes what is in them): the next sandbox actor on that node removes those
whose actor process (``PID``) is gone.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import tempfile
import threading
from pathlib import Path
from typing import Any

import ray

from ..config import SandboxConfig
from .local import LocalDriver

log = logging.getLogger("hermes_modal_tool")

TOKEN_BYTES = 32
ROOT_PREFIX = "hermes-modal-tool-ray-"
#: Seconds the actor waits for the host's connection (with the token) after ``start``.
ACCEPT_TIMEOUT_S = 60.0
#: Seconds a connection may take to send the token before it is closed.
TOKEN_TIMEOUT_S = 10.0


class _Relay(asyncio.Protocol):
    """One TCP connection to the actor's port: the token first, then the agent's stdin."""

    def __init__(self, actor: SandboxActor) -> None:
        self.actor = actor
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.authed = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        if self.actor.connected:
            transport.abort()
            return
        self.timer = asyncio.get_running_loop().call_later(TOKEN_TIMEOUT_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        if self.authed:
            self.actor.handle.write(data)
            return
        self.buffer += data
        if len(self.buffer) < TOKEN_BYTES:
            return
        given, rest = self.buffer[:TOKEN_BYTES], self.buffer[TOKEN_BYTES:]
        self.buffer = b""
        if self.timer is not None:
            self.timer.cancel()
        if self.actor.connected or not hmac.compare_digest(given, self.actor.token):
            log.warning("sandbox %s: refused a connection to its stream (wrong token)",
                        self.actor.sandbox_id)
            self.transport.abort()  # type: ignore[union-attr]
            return
        self.authed = True
        self.actor.accepted(self)
        if rest:
            self.actor.handle.write(rest)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.authed:
            self.actor.stream_closed()


class SandboxActor:
    """A sandbox on one Ray node (an async actor; see the module docstring).

    The sandbox's work (the local driver, the relay) runs on an event loop of its own, a
    plain asyncio one on a thread of the actor: Ray serves an async actor's calls on uvloop
    when it is installed, and uvloop lacks what the local driver uses (the ``user`` and
    ``group`` arguments of ``create_subprocess_exec``, and a child watcher: the actor's
    process gets asyncio's own event loop policy back).
    """

    def __init__(self) -> None:
        asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
        self._loop = asyncio.SelectorEventLoop()
        threading.Thread(target=self._loop.run_forever, name="hermes-modal-tool sandbox loop",
                         daemon=True).start()
        self.sandbox_id = ""
        self.token = b""
        self.connected = False
        self.handle: Any = None
        self._driver: LocalDriver | None = None
        self._server: asyncio.AbstractServer | None = None
        self._relay: _Relay | None = None
        self._ended: str | None = None
        self._stopping: asyncio.Task | None = None
        self._accept_timer: asyncio.TimerHandle | None = None
        self._driver_options: dict[str, Any] = {}

    async def _on_loop(self, coro) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def start(self, config: SandboxConfig, sandbox_id: str, token: bytes,
                    local_options: dict[str, Any]) -> dict[str, Any]:
        """Start the agent with the local driver on this node and open its port.

        ``config`` is the profile (its ``driver`` is ignored here), ``token`` the
        sandbox's :data:`TOKEN_BYTES` secret, ``local_options`` the ``LocalDriver``
        arguments. Returns ``init`` (the agent's init config), ``host``/``port`` (the
        stream), ``node_id``, ``node_ip``, ``pid`` (the actor's) and ``agent_pid``.

        Raises:
            SandboxStartError: from the local driver (bubblewrap missing, ...).
        """
        return await self._on_loop(self._start(config, sandbox_id, token, local_options))

    async def _start(self, config: SandboxConfig, sandbox_id: str, token: bytes,
                     local_options: dict[str, Any]) -> dict[str, Any]:
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"token: need {TOKEN_BYTES} bytes, got {len(token)}")
        self.sandbox_id, self.token = sandbox_id, token
        await asyncio.to_thread(_sweep_dead_roots)
        self._driver_options = local_options
        self._driver = _local_driver(local_options)
        local = config.model_copy(update={"driver": "local"})
        self.handle, init = await self._driver.start_sandbox(local, sandbox_id)
        ip = ray.util.get_node_ip_address()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Relay(self), ip, 0)
        port = self._server.sockets[0].getsockname()[1]
        self._accept_timer = loop.call_later(ACCEPT_TIMEOUT_S, self._no_connection)
        return {"init": init, "host": ip, "port": port, "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ip, "pid": os.getpid(), "agent_pid": self.handle.proc.pid}

    def accepted(self, relay: _Relay) -> None:
        """The host connected with the token: relay the agent's stdout to it; no more
        connections."""
        self.connected, self._relay = True, relay
        if self._accept_timer is not None:
            self._accept_timer.cancel()
        self._server.close()  # type: ignore[union-attr]
        self.handle.attach(relay.transport.write, self._agent_closed)  # type: ignore[union-attr]

    def _agent_closed(self) -> None:
        self._ended = self.handle.poll() or "the agent closed its stream"
        if self._relay is not None and self._relay.transport is not None:
            self._relay.transport.close()

    def _no_connection(self) -> None:
        log.warning("sandbox %s: no connection from the host within %g s: stopping",
                    self.sandbox_id, ACCEPT_TIMEOUT_S)
        self.stream_closed()

    def stream_closed(self) -> None:
        """The host's stream closed (it stopped the sandbox, or it is gone): stop the agent."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self._stop())

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._relay is not None and self._relay.transport is not None:
            self._relay.transport.close()
        if self.handle is not None:
            await self.handle.terminate()
        if self._driver is not None:
            await self._driver.aclose()
            if "state_root" not in self._driver_options:
                await asyncio.to_thread(_remove_tree, self._driver.state_root)

    async def stop(self) -> None:
        """Stop the agent and remove its state (bounded: the local driver's terminate)."""
        await self._on_loop(self._stop_once())

    async def _stop_once(self) -> None:
        self.stream_closed()
        await self._stopping  # type: ignore[misc]

    async def why(self) -> str | None:
        """Why the agent ended (its exit status and last stderr line), None while it runs."""
        return self._ended

    async def watch(self) -> None:
        """Never returns while the actor lives: the host awaits it to learn at once (from
        Ray) that the actor or its node is gone."""
        await asyncio.Event().wait()


def _local_driver(options: dict[str, Any]) -> LocalDriver:
    """The node's local driver, its directories named for this actor's process (see the
    module docstring); ``options`` may name a ``state_root`` of the caller's own."""
    tag = f"{ROOT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    given = "state_root" in options
    driver = LocalDriver(**({**options} if given else {**options, "state_root": Path(tempfile.gettempdir()) / tag}))
    if driver.ctl_root is not None:
        os.rmdir(driver.ctl_root)
        driver.ctl_root = driver.ctl_root.parent / tag
        driver.ctl_root.mkdir(mode=0o711)
        os.chmod(driver.ctl_root, 0o711)
    return driver


def _remove_tree(path: os.PathLike[str] | str) -> None:
    from ..agent.fs.trees import remove_tree

    remove_tree(str(path))


def _sweep_dead_roots() -> None:
    """Remove this node's sandbox actor directories whose actor process is gone."""
    for parent in {tempfile.gettempdir(), "/dev/shm"}:
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            if not name.startswith(ROOT_PREFIX):
                continue
            pid = name[len(ROOT_PREFIX):].split("-", 1)[0]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                try:
                    _remove_tree(os.path.join(parent, name))
                except OSError as exc:
                    log.warning("could not remove %s (its sandbox actor is gone): %s", name, exc)
