"""ToolBackend: the engine's front door (profiles -> pools -> sandboxes -> slots).

Example:
    >>> import asyncio
    >>> from hermes_modal_tool import SandboxConfig, ToolBackend
    >>> async def main():
    ...     backend = ToolBackend(SandboxConfig(slots_per_sandbox=2, min_sandboxes=1))
    ...     await backend.start()
    ...     slot = await backend.acquire("traj-1")
    ...     [r] = await backend.execute_batch([(slot, "bash", {"command": "echo hi"})])
    ...     await backend.release(slot)
    ...     await backend.stop()
    ...     return r.output
    >>> asyncio.run(main())  # doctest: +SKIP
    'hi\\n'
"""

from __future__ import annotations

import asyncio
import os
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import tracing
from ._artifact_api import ArtifactMethods
from ._call_api import CallMethods, execute_streamed
from ._call_group import checked_requests, execute_grouped
from ._snapshot_api import SnapshotMethods
from ._status_api import StatusMethods
from .config import ModalSandboxConfig, SandboxConfig, load_profiles
from .drivers import make_driver
from .drivers.base import Driver
from .errors import BackendClosedError, ConfigError, ConfigWarning, UsageError
from .filetransfer import TransferMethods
from .pool import SandboxPool
from .previews import PreviewMethods
from .processes import ProcessMethods
from .shared_setup import SharedSetups
from .slots import ExecutionResult, OutputEvent, Slot
from .snapshots import SlotSnapshot, Snapshots
from .usage import Usage


class ToolBackend(CallMethods, SnapshotMethods, ArtifactMethods, ProcessMethods, StatusMethods, TransferMethods,
                  PreviewMethods):
    """Pools of sandboxes per profile, slots leased to trajectories, batched tool calls.

    Resembles the original Atropos ``ModalToolBackend``: construct with one config,
    or with several profiles through :meth:`with_profiles`; ``await start()``,
    ``acquire``/``execute_batch``/``release``, ``await stop()``. Also an async
    context manager.

    Args:
        config: a single profile (its ``name`` becomes the default profile).
        profiles: several profiles by name (instead of ``config``).
        default_profile: the profile ``acquire`` uses when none is named. It may be
            missing from ``profiles``: then a call that names no profile raises
            ConfigError (and ``start()`` warms nothing by default).
        app_name: prefix for each profile's app name (``"{app_name}-{profile}"``).
        driver_options: options per driver name, e.g. ``{"local": {"state_root": path},
            "modal": {"create_rate": 10, "max_starting": 8}}`` (see ``LocalDriver`` and
            ``ModalDriver``).
        host_processes: K > 1 spreads each profile's sandboxes over K host processes
            (each its own event loop on its own core, owning its share of ``min_sandboxes``
            and ``max_sandboxes``) behind this same API; 1: all in this process; None
            (default): ``HERMES_MODAL_TOOL_HOST_PROCESSES``, else 1.
            See ``hostprocs/router.py`` for what differs (a fork's slots come from the
            process holding its source; a file object is copied through a temporary file).

    Raises:
        ConfigError: bad profiles, driver options or ``host_processes``.
    """

    def __new__(cls, *args: Any, host_processes: int | None = None, **kwargs: Any) -> ToolBackend:
        from .hostprocs import resolve_host_processes

        if resolve_host_processes(host_processes) == 1 or getattr(cls, "_split", False):
            return super().__new__(cls)
        from .hostprocs.router import split_class

        made: ToolBackend = super().__new__(split_class(cls))
        return made

    def __init__(
        self,
        config: SandboxConfig | None = None,
        *,
        profiles: Mapping[str, SandboxConfig] | None = None,
        default_profile: str | None = None,
        app_name: str | None = None,
        driver_options: Mapping[str, Any] | None = None,
        host_processes: int | None = None,
    ) -> None:
        if config is not None and profiles is not None:
            raise UsageError("give either config or profiles, not both")
        if profiles is not None and not isinstance(profiles, Mapping):
            raise UsageError(f"profiles must be a mapping of name -> SandboxConfig, got {profiles!r:.80}")
        if profiles is None:
            config = config if config is not None else self._default_config()
            if not isinstance(config, SandboxConfig):
                raise UsageError(f"config must be a SandboxConfig, got {type(config).__name__}")
            profiles = {config.name: config}
            default_profile = default_profile or config.name
        profiles = dict(profiles)
        if not profiles:
            raise ConfigError("no profiles given")
        for name, cfg in profiles.items():
            if not isinstance(cfg, SandboxConfig):
                raise ConfigError(f"profile {name!r}: expected a SandboxConfig, got {type(cfg).__name__}")
            if cfg.name != name:
                profiles[name] = cfg = cfg.model_copy(update={"name": name})
            if app_name and not cfg.app_name:
                profiles[name] = cfg.with_app_name(app_name)
        # A default that is not a profile is allowed until a call needs it (code that
        # names a profile on every call never does); profile(None) then raises.
        default_profile = default_profile or "default"
        if not isinstance(default_profile, str):
            raise ConfigError(f"default_profile must be a profile name, got {default_profile!r:.80} "
                              f"(profiles: {', '.join(profiles)})")
        self.profiles: dict[str, SandboxConfig] = profiles
        self.default_profile = default_profile
        self.app_name = app_name
        self._driver_options = dict(driver_options or {})
        for key, value in self._driver_options.items():
            if key not in ("local", "modal", "ray") or not isinstance(value, Mapping):
                raise ConfigError(f"driver_options: key {key!r} must be a driver name ('local', "
                                  f"'modal' or 'ray') mapping to that driver's options, got {value!r:.80}")
        self._drivers: dict[str, Driver] = {}
        self._pools: dict[str, SandboxPool] = {}
        self._pool_locks: dict[str, asyncio.Lock] = {}
        self._started = False
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._snapshots = Snapshots(self)
        self._setups = SharedSetups(self)
        self._id_tag = ""  # in sandbox and snapshot ids; a host process's: "h{index}."
        self.host_processes = 1  # a split backend's (hostprocs/router.py) sets its own

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop this backend runs on (set by the first ``start``/``acquire``).

        Every coroutine of the backend must be awaited on this loop; from sync code or
        another loop, submit them with :func:`hermes_modal_tool.portal.run_sync` (after
        starting the backend there) or ``asyncio.run_coroutine_threadsafe``.
        """
        return self._loop

    @staticmethod
    def _default_config() -> SandboxConfig:
        return SandboxConfig()

    @property
    def default_timeout_s(self) -> float | None:
        """The default profile's ``execution_timeout_s`` (seconds; None when the
        default profile is not one of the profiles)."""
        cfg = self.profiles.get(self.default_profile)
        return cfg.execution_timeout_s if cfg is not None else None

    @classmethod
    def with_profiles(
        cls,
        app_name: str = "hermes-modal-tool",
        profiles: Mapping[str, SandboxConfig] | None = None,
        default_profile: str | None = None,
        profiles_file: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> ToolBackend:
        """A backend with several profiles, given directly or loaded from a YAML file/env.

        Args:
            default_profile: the profile ``acquire`` uses by default (default: the
                file's ``default_profile:``, else ``"default"``).

        Raises:
            ConfigError: the profiles file or environment is invalid (nothing falls back).
        """
        if profiles is None:
            config_cls = ModalSandboxConfig if cls is ModalToolBackend else SandboxConfig
            profiles, file_default = load_profiles(profiles_file, cls=config_cls)
            default_profile = default_profile or file_default
        return cls(profiles=profiles, default_profile=default_profile or "default",
                   app_name=app_name, **kwargs)

    # -- lifecycle -------------------------------------------------------------------
    async def start(self, profiles_to_start: Sequence[str] | None = None) -> None:
        """Start pools and pre-warm their ``min_sandboxes``.

        Args:
            profiles_to_start: which profiles to warm now (default: the default
                profile); others start on their first ``acquire``.

        Raises:
            SandboxStartError: a warm sandbox failed to start.
            ConfigError: an unknown profile name, or a secret is missing.
        """
        self._check_open()
        if isinstance(profiles_to_start, str):
            raise UsageError(f"profiles_to_start must be a list of profile names, got the string "
                             f"{profiles_to_start!r}; use [{profiles_to_start!r}]")
        if not profiles_to_start and self.default_profile not in self.profiles:
            warnings.warn(f"start(): default_profile {self.default_profile!r} is not one of the "
                          f"profiles ({', '.join(self.profiles)}); no pool warmed now, each starts on "
                          "its first acquire", ConfigWarning, stacklevel=2)
            names: list[str] = []
        else:
            names = list(profiles_to_start or [self.default_profile])
        for name in names:
            self.profile(name)
        await asyncio.gather(*(self._pool(n) for n in names))
        self._started = True

    async def stop(self, purge: bool = False) -> None:
        """Terminate every sandbox this backend started and remove its state. Idempotent.

        Args:
            purge: also forget the pools (kept for the original's signature; a
                stopped backend cannot be restarted either way).
        """
        if self._closed:
            return
        self._check_open()  # on the backend's own loop
        self._closed = True
        await self._unexpose_all()  # previews: listeners and their connections close
        await self._setups.close()
        await self._snapshots.close()
        await asyncio.gather(*(p.stop() for p in self._pools.values()), return_exceptions=True)
        await asyncio.gather(*(d.aclose() for d in self._drivers.values()), return_exceptions=True)
        if purge:
            self._pools.clear()

    async def __aenter__(self) -> ToolBackend:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosedError("this backend was stopped; create a new one")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise UsageError(
                "this backend runs on another event loop (the one it was started on); "
                "await it there, e.g. with asyncio.run_coroutine_threadsafe(coro, backend.loop) "
                "or hermes_modal_tool.portal.run_sync after starting it with run_sync")

    def profile(self, name: str | None = None) -> SandboxConfig:
        """The named profile's config (the default profile for None).

        Raises:
            ConfigError: no such profile.
        """
        if not name:
            if self.default_profile not in self.profiles:
                raise ConfigError(
                    f"default_profile {self.default_profile!r} is not one of the profiles "
                    f"({', '.join(self.profiles)}); name a profile in this call (profile=...) or "
                    "pass default_profile= one of them")
            name = self.default_profile
        try:
            return self.profiles[name]
        except KeyError:
            raise ConfigError(f"unknown profile {name!r}; known profiles: {', '.join(self.profiles)}") from None

    async def _pool(self, name: str) -> SandboxPool:
        pool = self._pools.get(name)
        if pool is not None:
            return pool
        lock = self._pool_locks.setdefault(name, asyncio.Lock())
        async with lock:
            pool = self._pools.get(name)
            if pool is None:
                cfg = self.profile(name)
                driver = self._drivers.get(cfg.driver)
                if driver is None:
                    driver = self._drivers[cfg.driver] = make_driver(
                        cfg.driver, **self._driver_options.get(cfg.driver, {}))
                pool = SandboxPool(cfg, driver, self._id_tag)
                self._pools[name] = pool
                await pool.start()
        return pool

    # -- slots -------------------------------------------------------------------------
    async def acquire(self, trajectory_id: str | None = None, profile: str | None = None,
                      snapshot: SlotSnapshot | None = None,
                      setup: str | list[str] | None = None) -> Slot:
        """Lease a slot (empty workspace, fresh shell) for a trajectory.

        Args:
            trajectory_id: who holds it (shown in status and pool-timeout errors);
                None: a new id (``"traj-"`` and 12 hex digits), as the original did.
            profile: which profile's pool (default: ``default_profile``; with a
                ``snapshot``, the snapshot's).
            snapshot: start the slot from this snapshot (``fork(snapshot, 1)``): its
                files, working directory, exported variables, functions and aliases.
            setup: commands the slot starts after (default: the profile's ``setup``):
                run once per content key (see :meth:`setup_snapshot`), then forked.

        Raises:
            PoolTimeoutError: no slot became free within the profile's ``acquire_timeout_s``.
            SandboxStartError: a needed sandbox failed to start.
            ConfigError: unknown profile.
            SetupError: the ``setup`` failed (see :meth:`setup_snapshot`).
            BackendClosedError: after ``stop()``.
        """
        self._check_open()
        with tracing.span("acquire", {"trajectory_id": trajectory_id, "profile": profile}) as span:
            slot = await self._acquire(trajectory_id, profile, snapshot, setup)
            tracing.set_attributes(span, {"slot_id": slot.slot_id, "sandbox_id": slot.sandbox_id,
                                          "profile": slot.profile, "trajectory_id": slot.trajectory_id})
            return slot

    async def _acquire(self, trajectory_id: str | None, profile: str | None,
                       snapshot: SlotSnapshot | None, setup: str | list[str] | None) -> Slot:
        if trajectory_id is not None and not isinstance(trajectory_id, str):
            raise UsageError(f"trajectory_id must be a string, got {type(trajectory_id).__name__}")
        if profile is not None and not isinstance(profile, str):
            raise UsageError(f"profile must be a profile name (a string), got {profile!r:.80}")
        if snapshot is not None:
            if profile is not None and isinstance(snapshot, SlotSnapshot) and profile != snapshot.profile:
                raise UsageError(f"snapshot {snapshot.snapshot_id} belongs to profile "
                                 f"{snapshot.profile!r}, not {profile!r}")
            return (await self.fork(snapshot, 1, None if trajectory_id is None else [trajectory_id]))[0]
        if setup is None:
            setup = self.profile(profile).setup
        if setup:
            snapshot = await self.setup_snapshot(setup, profile)
            return (await self.fork(snapshot, 1, None if trajectory_id is None else [trajectory_id]))[0]
        pool = await self._pool(self.profile(profile).name)
        return await pool.acquire(trajectory_id if trajectory_id is not None
                                  else f"traj-{uuid.uuid4().hex[:12]}")

    async def release(self, slot: Slot, reset_workspace: bool = False, *,
                      measure_disk: bool = False) -> Usage | None:
        """Return a slot. The next holder always gets an empty workspace and a fresh
        shell; ``reset_workspace=True`` does that reset before returning (with a layered
        root: once each of the old tenant's processes has been sent SIGKILL; they end and
        the slot is torn down in the sandbox meanwhile, and the slot's next call waits for
        that, see ``agent/slot.py``).

        Returns:
            What the trajectory used (:class:`Usage`), measured before the reset in one
            round trip to the agent; None after ``stop()`` or for a dead sandbox's slot
            released twice. ``measure_disk=True`` adds ``disk_bytes`` (a walk of the
            slot's files, linear in them; else None and the reset stays O(1)).

        Raises:
            UsageError: the slot is not held (already released, or not a Slot).
        """
        if not isinstance(slot, Slot):
            raise UsageError(f"release() takes a Slot, got {type(slot).__name__}")
        if self._closed:
            return None
        self._check_open()
        with tracing.span("release", {"slot_id": slot.slot_id, "trajectory_id": slot.trajectory_id,
                                      "reset_workspace": reset_workspace}) as span:
            used = await self._release(slot, reset_workspace, measure_disk)
            tracing.set_attributes(span, tracing.usage_attributes(used))
            return used

    async def _release(self, slot: Slot, reset_workspace: bool, measure_disk: bool) -> Usage | None:
        """The release itself, in the span :meth:`release` opens (host processes route it)."""
        pool = self._pools.get(slot.profile)
        if pool is None:
            raise UsageError(f"slot {slot.slot_id} does not belong to this backend")
        await self._unexpose_all(slot)  # its previews are revoked before its reset
        return await pool.release(slot, reset_workspace=reset_workspace, measure_disk=measure_disk)

    # -- execution ---------------------------------------------------------------------
    async def execute_batch(
        self,
        requests: Sequence[tuple[Slot, str, Mapping[str, Any]]],
        timeout_s: float | None = None,
        on_output: Callable[[OutputEvent], Any] | None = None,
    ) -> list[ExecutionResult]:
        """Run tool calls in parallel across slots; results come back in input order.

        Calls to the same slot run one after another in input order; calls to
        different slots (and sandboxes) run at the same time. A bad request or a
        failure of one call becomes a failed :class:`ExecutionResult` for that
        request only.

        Args:
            requests: ``(slot, tool, args)`` tuples; tools: ``bash`` {command,
                timeout, background, stdin, env}, ``read_file``, ``write_file``,
                ``list_files``, ``read_artifact``, ``list_artifacts``,
                ``archive_artifacts``.
            timeout_s: per-call timeout in seconds (default: the profile's
                ``execution_timeout_s``; a bash call's own ``timeout`` wins). It
                measures the command's own run time: the clock starts when the
                command starts in its slot's shell, not while the call waits for
                an earlier call to the same slot, for the slot's shell to start, or
                for admission. A sandbox starts new commands only while fewer than
                4 per CPU of its ``cpu`` limit are computing (commands that sleep or
                wait for I/O do not count; one counts until it ends or has used 1 s
                of CPU; a burst of up to 8 times as many may start at once, since
                most commands end within 20 ms) and queues the others, first come
                first served. On an overloaded machine a call can therefore take
                longer than its timeout to come back without having timed out.
            on_output: called on the event loop with each :class:`OutputEvent`
                (``index``: the request's position) while bash calls run, in the
                order the output came; a call's events all come before its result.
                An exception it raises is logged and ignored.

        Returns:
            One ExecutionResult per request. A timed-out command has
            ``metadata["returncode"] == 124`` and ``metadata["timed_out"]``.

        Raises:
            BackendClosedError: after ``stop()``.
            UsageError: ``requests`` is not a sequence or ``timeout_s`` is not a positive number.

        Cancelling the awaiting task stops the calls still running (their
        processes are killed) and re-raises CancelledError.
        """
        self._check_open()
        results, checked = checked_requests(requests, timeout_s)
        grouped = on_output is None
        valid = []  # the requests that pass the checks, (index, slot, tool, args, pool)
        # Grouped: those by the sandbox of their slot's lease (None for a slot whose lease
        # is gone: its call fails when submitted), in first-use order, each sandbox's in
        # input order (so that a slot's calls keep theirs).
        by_sandbox: dict[Any, list[tuple]] = {}
        for i, slot, tool, args in checked:
            pool = self._pools.get(slot.profile)
            if pool is None:
                results[i] = ExecutionResult.failure(f"slot {slot.slot_id} does not belong to this backend",
                                                     slot.slot_id, "slot_not_held")
                continue
            if not grouped:
                valid.append((i, slot, tool, args, pool))
                continue
            key = getattr(slot._sandbox, "sandbox", None)
            bucket = by_sandbox.get(key)
            if bucket is None:
                by_sandbox[key] = [(i, slot, tool, args, pool)]
            else:
                bucket.append((i, slot, tool, args, pool))
        if grouped:  # one CallGroup per sandbox (_call_group.py)
            if by_sandbox:
                await execute_grouped(by_sandbox, results, timeout_s, requests, tracing.active())
            return results  # type: ignore[return-value]
        await execute_streamed(valid, results, timeout_s, on_output)
        return results  # type: ignore[return-value]

class ModalToolBackend(ToolBackend):
    """:class:`ToolBackend` whose default profile is a :class:`ModalSandboxConfig` (driver ``modal``).

    The original Atropos name: code written for it works by changing the import.
    Pass ``ModalSandboxConfig(..., driver="local")`` to run the same code locally.
    """

    @staticmethod
    def _default_config() -> SandboxConfig:
        return ModalSandboxConfig()


