"""The Ray driver: each sandbox is a Ray actor running the agent on the node Ray placed it.

Needs the ``ray`` extra (``pip install 'hermes-modal-tool[ray]'``). Per sandbox:

1. one actor (:class:`._ray_actor.SandboxActor`) asking Ray for the profile's ``cpu``
   (``num_cpus``), ``memory`` (MiB, as Ray's ``memory`` resource), ``gpu`` (its count, as
   ``num_gpus``) and the driver's custom ``resources``; ``placement: spread`` spreads the
   actors over the nodes (Ray's ``SPREAD``), ``pack`` (the default) uses Ray's default
   scheduler, which fills a node before it uses the next;
2. the actor starts the agent with the local driver on its node (bubblewrap per slot,
   that node's image cache and ``.env`` secrets) and opens a TCP port on the node's
   address for it;
3. the host connects once and sends the sandbox's random 32-byte token before any frame:
   that stream carries the protocol both ways, so a command costs what it costs on the
   local driver plus one TCP hop; no Ray task or RPC per command.

When a node is lost (or the actor dies), the host learns it from the stream's end or from
Ray (an ``ActorDiedError`` on the actor's ``watch`` call, whichever comes first): the
sandbox's in-flight calls fail with an error naming the node, and the pool replaces the
sandbox on a node Ray picks. Orphans: the actor is owned by the host process, so Ray
kills it (and with it the agent) when that process is gone; the actor also stops the
agent when the host's stream closes.

The cluster: ``address`` (an option of the driver), else ``RAY_ADDRESS``, else the one
this process already joined (``ray.init`` done by the caller, e.g. an RL trainer), else a
new local one (``ray.init()`` with ``init_options``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from typing import Any

import ray

from ..config import SandboxConfig
from ..errors import ConfigError, SandboxStartError
from ..gpus import parse_gpu
from ._ray_actor import TOKEN_BYTES, SandboxActor
from .base import Driver, SandboxHandle

log = logging.getLogger("hermes_modal_tool")

PLACEMENTS = ("pack", "spread")
LOCAL_CLUSTER = "a new local cluster"
MIB = 1024 * 1024
#: Seconds to tell, after a stream ended by surprise, whether the actor is still there to
#: say why (its agent exited) or gone with its node.
EXPLAIN_S = 2.0


class _Stream(asyncio.Protocol):
    """The host's end of a sandbox's stream: delivered to a callback once attached."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer: list[bytes] = []
        self.on_data = self.buffer.append
        self.closed: asyncio.Future = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.on_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)


class RayHandle(SandboxHandle):
    """A sandbox on a Ray node: the agent's stdio as one TCP stream (see the module)."""

    def __init__(self, sandbox_id: str, actor: Any, stream: _Stream, where: dict[str, Any]) -> None:
        self.sandbox_id = sandbox_id
        self.actor = actor
        self.node_id: str = where["node_id"]
        self.node_ip: str = where["node_ip"]
        self.actor_pid: int = where["pid"]
        self.agent_pid: int = where["agent_pid"]
        self._stream = stream
        self._reason: str | None = None
        self._stopping = False
        self._on_close = None
        self._chunks: asyncio.Queue[bytes] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._watch = loop.create_task(self._watch_actor(), name=f"hermes-modal-tool ray watch {sandbox_id}")
        self._ended = loop.create_task(self._stream_ended(), name=f"hermes-modal-tool ray stream {sandbox_id}")

    @property
    def node(self) -> str:
        return f"Ray node {self.node_id[:12]} ({self.node_ip})"

    async def _watch_actor(self) -> None:
        """Ray says the actor is gone (its node was lost, or it was killed): close the
        stream at once, whatever TCP says."""
        try:
            await self.actor.watch.remote()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._reason is None and not self._stopping:
                self._reason = await self._gone(exc)
            if self._stream.transport is not None:
                self._stream.transport.abort()

    async def _gone(self, exc: Exception) -> str:
        """Why the actor is gone: its node is dead (Ray's node table), or the actor alone."""
        try:
            alive = await asyncio.wait_for(asyncio.to_thread(_node_alive, self.node_id), EXPLAIN_S)
        except Exception:
            alive = None
        if alive is False:
            return f"{self.node} was lost (Ray: the node is dead)"
        return f"the sandbox actor on {self.node} died ({type(exc).__name__}: {_ray_error(exc)})"

    async def _stream_ended(self) -> None:
        exc = await self._stream.closed
        if self._reason is None and not self._stopping:
            self._reason = await self._explain(exc)
        if self._on_close is not None:
            self._on_close()
        else:
            self._chunks.put_nowait(b"")

    async def _explain(self, exc: Exception | None) -> str:
        """Why the stream ended: the actor's word (its agent exited), else its node is gone."""
        try:
            why = await asyncio.wait_for(self.actor.why.remote(), EXPLAIN_S)
        except Exception as err:  # ActorDiedError, unreachable node, timeout
            if self._reason is not None:  # the watch said it meanwhile
                return self._reason
            return (f"{self.node} was lost or its sandbox actor died: the stream closed"
                    f"{f' ({exc})' if exc else ''} and the actor does not answer ({type(err).__name__})")
        return f"{self.node}: {why or 'the sandbox stream closed'}"

    def attach(self, on_data, on_close) -> bool:
        for chunk in self._stream.buffer:
            on_data(chunk)
        self._stream.buffer.clear()
        self._stream.on_data = on_data
        self._on_close = on_close
        return True

    async def read(self) -> bytes:
        if self._stream.on_data != self._chunks.put_nowait:
            for chunk in self._stream.buffer:
                self._chunks.put_nowait(chunk)
            self._stream.buffer.clear()
            self._stream.on_data = self._chunks.put_nowait
        return await self._chunks.get()

    def write(self, data: bytes) -> None:
        transport = self._stream.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def poll(self) -> str | None:
        return self._reason

    async def terminate(self) -> None:
        self._stopping = True
        self._reason = self._reason or f"{self.node}: stopped by the backend"
        if self._stream.transport is not None:
            self._stream.transport.close()  # EOF: the actor stops the agent
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.actor.stop.remote(), 10)
        with contextlib.suppress(Exception):
            ray.kill(self.actor)
        for task in (self._watch, self._ended):
            if not task.done():
                task.cancel()
            with contextlib.suppress(BaseException):
                await task


class RayDriver(Driver):
    """Starts sandboxes as Ray actors (see the module docstring).

    Args:
        address: the cluster to join (``ray.init(address=...)``: ``"auto"``,
            ``"ray://host:10001"``, ``"host:6379"``); default ``RAY_ADDRESS``, else the
            cluster this process already joined, else a new local one.
        placement: ``"pack"`` (Ray's default scheduler) or ``"spread"`` (``SPREAD``).
        resources: custom Ray resources each sandbox needs, e.g. ``{"rollout": 1}``.
        init_options: extra ``ray.init`` keyword arguments (a new local cluster:
            ``num_cpus``, ``object_store_memory``, ...).
        local_options: the ``LocalDriver`` options used on each node (``state_root``,
            ``image_cache``: paths on the nodes).
        start_timeout: seconds a sandbox may take to be placed and start (a request no
            node can meet waits in Ray's queue until then).

    Raises:
        ConfigError: a bad option (named, with the value).
    """

    name = "ray"

    def __init__(self, address: str | None = None, placement: str = "pack",
                 resources: dict[str, float] | None = None, init_options: dict[str, Any] | None = None,
                 local_options: dict[str, Any] | None = None, start_timeout: float = 120.0) -> None:
        if placement not in PLACEMENTS:
            raise ConfigError(f"driver 'ray': placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
        for key, value in (resources or {}).items():
            if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or value <= 0:
                raise ConfigError(f"driver 'ray': resources[{key!r}] must be a positive number, got {value!r}")
        if not start_timeout > 0:
            raise ConfigError(f"driver 'ray': start_timeout must be > 0 seconds, got {start_timeout!r}")
        self.address = address
        self.placement = placement
        self.resources = dict(resources or {})
        self.init_options = dict(init_options or {})
        self.local_options = dict(local_options or {})
        self.start_timeout = float(start_timeout)
        self._joined: str | None = None  # how this driver found its cluster
        self._join_lock: asyncio.Lock | None = None
        self._remote = ray.remote(SandboxActor)

    async def _join(self) -> None:
        if self._joined is not None:
            return
        if self._join_lock is None:
            self._join_lock = asyncio.Lock()
        async with self._join_lock:
            if self._joined is None:
                self._joined = await asyncio.to_thread(self._join_sync)

    def _join_sync(self) -> str:
        if ray.is_initialized():
            return "the cluster this process had joined"
        address = self.address or os.environ.get("RAY_ADDRESS") or None
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no report to anyscale.com
        options = {"include_dashboard": False, "log_to_driver": False, **self.init_options}
        try:
            ray.init(address=address, **options)
        except Exception as exc:
            raise SandboxStartError(f"driver 'ray': could not join the Ray cluster "
                                    f"{address or '(a new local one)'}: {type(exc).__name__}: {exc}") from None
        return f"cluster at {address}" if address else LOCAL_CLUSTER

    def _actor_options(self, config: SandboxConfig) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": config.cpu, "memory": config.memory * MIB,
                                   "max_restarts": 0, "max_task_retries": 0,
                                   "scheduling_strategy": "SPREAD" if self.placement == "spread" else "DEFAULT"}
        if self.resources:
            options["resources"] = self.resources
        if config.gpu:
            options["num_gpus"] = parse_gpu(config.gpu).count
        return options

    async def start_sandbox(self, config: SandboxConfig, sandbox_id: str) -> tuple[SandboxHandle, dict[str, Any]]:
        await self._join()
        options = self._actor_options(config)
        actor = self._remote.options(name=None, **options).remote()
        token = secrets.token_bytes(TOKEN_BYTES)
        stream = None
        try:
            try:
                where = await asyncio.wait_for(
                    actor.start.remote(config, sandbox_id, token, self.local_options), self.start_timeout)
            except asyncio.TimeoutError:
                raise SandboxStartError(
                    f"sandbox {sandbox_id}: no Ray node took it within {self.start_timeout:g} s "
                    f"(it asks for {_describe(options)}; the cluster has "
                    f"{_describe(ray.cluster_resources())}, free {_describe(ray.available_resources())})"
                ) from None
            except ray.exceptions.RayError as exc:
                raise SandboxStartError(f"sandbox {sandbox_id}: the Ray actor could not start it: "
                                        f"{_ray_error(exc)}") from None
            stream = _Stream()
            loop = asyncio.get_running_loop()
            try:
                await asyncio.wait_for(loop.create_connection(lambda: stream, where["host"], where["port"]), 30)
            except (OSError, asyncio.TimeoutError) as exc:
                raise SandboxStartError(f"sandbox {sandbox_id}: could not reach its stream on Ray node "
                                        f"{where['node_ip']} port {where['port']}: {exc!r}") from None
            stream.transport.write(token)  # type: ignore[union-attr]
            return RayHandle(sandbox_id, actor, stream, where), where["init"]
        except BaseException:
            if stream is not None and stream.transport is not None:
                stream.transport.abort()
            with contextlib.suppress(Exception):
                ray.kill(actor)
            raise

    async def aclose(self) -> None:
        """Shut the local cluster down if this driver started it (a joined one is left)."""
        if self._joined == LOCAL_CLUSTER and ray.is_initialized():
            await asyncio.to_thread(ray.shutdown)
        self._joined = None

    def describe(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"driver": self.name, "placement": self.placement,
                                 "resources": self.resources, "cluster": self._joined}
        if self._joined is not None and ray.is_initialized():
            facts["nodes"] = sum(1 for n in ray.nodes() if n.get("Alive"))
        return facts


def _describe(resources: dict[str, Any]) -> str:
    resources = {**resources, **resources.get("resources", {})}
    shown = {k: v for k, v in resources.items() if not k.startswith(("node:", "accelerator_type:"))
             and k not in ("scheduling_strategy", "max_restarts", "max_task_retries", "resources")}
    return ", ".join(f"{k}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}"
                     for k, v in sorted(shown.items())) or "nothing"


def _node_alive(node_id: str) -> bool | None:
    """Whether Ray's node table says the node is alive; None if it does not list it."""
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return bool(node.get("Alive"))
    return None


def _ray_error(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    # A task error carries the remote traceback; its last line is the cause.
    return text[-1][:300] if text else type(exc).__name__
