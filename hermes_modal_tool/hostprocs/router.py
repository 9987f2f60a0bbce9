"""``ToolBackend(..., host_processes=K)``: one backend API over K host processes.

Each host process (``worker.py``) runs an ordinary backend owning its share of every
profile's ``min_sandboxes`` and ``max_sandboxes``, on its own event loop and core, so the
host's work per call (frames, results, the sandboxes' pipes) is spread over K cores
instead of one. This router keeps the caller's objects (slots, snapshots, previews) and
sends each request to the process that holds its slot or snapshot:

- ``acquire`` (and ``setup_snapshot``, ``import_snapshot``) go to the process with the
  fewest slots of the profile leased out, among those with room;
- ``execute_batch`` sends each process its calls as one message and their results come
  back as one (a call costs the router about a microsecond of pickling either way);
- a fork's slots come from the process holding its source (a slot or snapshot);
- ``get_status`` merges the processes' statuses (asked synchronously, up to 5 s each).

A host process that exits fails its own slots' calls as a dead sandbox does
(``reason="sandbox_died"``) and nothing else; its slots are in ``ERROR``. Host processes
die with the router (``PR_SET_PDEATHSIG``) and stop their sandboxes when it closes them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from .. import tracing
from .._call_group import checked_requests
from ..errors import ConfigError, SandboxDiedError, UsageError
from ..previews import Preview
from ..slots import ExecutionResult, OutputEvent, Slot, SlotState
from ..snapshots import SlotSnapshot, in_use
from . import resolve_host_processes, wire
from ._router_data import RouterData, merge_statuses, split_shares
from .host import HostProc

log = logging.getLogger("hermes_modal_tool")
_CLASSES: dict[type, type] = {}


def split_class(cls: type) -> type:
    """``cls`` (a ToolBackend class) with :class:`HostRouter` in front (made once per class)."""
    made = _CLASSES.get(cls)
    if made is None:
        made = _CLASSES[cls] = type(f"Split{cls.__name__}", (HostRouter, RouterData, cls),
                                    {"__module__": cls.__module__, "__doc__": cls.__doc__, "_split": True})
    return made


class HostRouter:
    """The methods of ToolBackend that reach sandboxes, routed to host processes (see the
    module's docstring). Every other method is built on these."""

    def __init__(self, *args: Any, host_processes: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.host_processes = resolve_host_processes(host_processes)
        self._hosts: list[HostProc] = []
        self._exited: list[HostProc] = []  # replaced; their slots' calls fail, releases pass
        self._replacing: set[asyncio.Task] = set()
        self._hosts_ready: asyncio.Future | None = None
        self._snap_hosts: dict[str, HostProc] = {}
        self._host_previews: list[tuple[Preview, HostProc]] = []
        self._turn = itertools.count()

    # -- host processes ------------------------------------------------------------
    async def _started_hosts(self) -> list[HostProc]:
        if self._hosts_ready is None:
            self._hosts_ready = asyncio.ensure_future(self._start_hosts())
        await asyncio.shield(self._hosts_ready)
        return self._hosts

    async def _start_hosts(self) -> None:
        shares = split_shares(self.profiles, self.host_processes)  # type: ignore[attr-defined]
        hosts = [HostProc(i, share, on_lost=self._lost) for i, share in enumerate(shares)]
        self._hosts = hosts
        results = await asyncio.gather(*(h.start(self._init_for(h)) for h in hosts), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(h.close() for h in hosts if h.alive))
            raise failed[0]

    def _lost(self, host: HostProc) -> None:
        """A host process exited: unless the backend is stopping, a new one takes its
        place and its share (its slots stay failed, as a dead sandbox's)."""
        if self._closed or host not in self._hosts:  # type: ignore[has-type]
            return
        log.error("%s; starting a new one in its place", host.gone())
        serial = max(h.serial for h in self._hosts + self._exited) + 1
        fresh = HostProc(host.index, host.shares, serial, on_lost=self._lost)
        self._hosts[self._hosts.index(host)] = fresh
        self._exited.append(host)
        task = asyncio.ensure_future(self._replace(fresh))
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _replace(self, fresh: HostProc) -> None:
        try:
            await fresh.start(self._init_for(fresh))
            started = [n for n in fresh.shares if fresh.shares[n][0]]
            if started:
                await self._ask(fresh, "start", started)
        except Exception as exc:  # noqa: BLE001 - logged; the place stays empty (alive False)
            log.error("host process %d could not be replaced: %s", fresh.index, exc)

    def _init_for(self, host: HostProc) -> dict[str, Any]:
        profiles = {name: cfg.model_copy(update={"min_sandboxes": host.shares[name][0],
                                                 "max_sandboxes": host.shares[name][1]})
                    for name, cfg in self.profiles.items() if name in host.shares}  # type: ignore[attr-defined]
        return {"profiles": profiles, "default_profile": self.default_profile,  # type: ignore[attr-defined]
                "app_name": self.app_name, "driver_options": self._driver_options}  # type: ignore[attr-defined]

    async def _ask(self, where: HostProc, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` of the host process's backend; its value unpacked."""
        packed = tuple(self._ref(a) for a in args)
        try:
            value, touched = await where.request("call", (method, packed, kwargs))
        except wire.HostProcessGone as exc:
            raise SandboxDiedError(str(exc)) from None
        for arg, view in zip((a for a in args if isinstance(a, Slot)), touched, strict=True):
            wire.apply_slot_view(arg, view)
        return self._unpack(where, value)

    def _ref(self, arg: Any) -> Any:
        if isinstance(arg, Slot):
            self._host_of(arg)
            return wire.SlotRef(arg.lease_id, arg.slot_id, arg.profile)
        if isinstance(arg, SlotSnapshot):
            return wire.SnapRef(arg.snapshot_id)
        if isinstance(arg, Preview):
            return wire.PreviewRef(arg.slot_id, arg.port, arg.url)
        return arg

    def _unpack(self, host: HostProc, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], wire.View):
            return [self._unpack(host, v) for v in value]
        if not isinstance(value, wire.View):
            return value
        if value.kind == "slot":
            slot = wire.apply_slot_view(Slot("", ""), value)
            slot._sandbox = host
            host.held[slot.profile] = host.held.get(slot.profile, 0) + 1
            return slot
        if value.kind == "snapshot":
            snap = RoutedSnapshot(**value.fields)
            self._snap_hosts[snap.snapshot_id] = host
            return snap
        preview = Preview(**value.fields)
        self._host_previews = [(p, h) for p, h in self._host_previews if not p.revoked] + [(preview, host)]
        return preview

    def _owns(self, host: Any) -> bool:
        """Whether ``host`` (a slot's ``_sandbox``) is one of this backend's host processes,
        running or replaced."""
        return isinstance(host, HostProc) and (host in self._hosts or host in self._exited)

    def _host_of(self, slot: Slot) -> HostProc:
        host = slot._sandbox
        if not self._owns(host):
            raise UsageError(f"slot {slot.slot_id} does not belong to this backend")
        return host  # type: ignore[no-any-return]

    def _revoke_previews(self, slot_id: str | None = None, port: int | None = None) -> None:
        """Mark the caller's previews revoked: all, a slot's, or one port of a slot's (as
        their host process revokes them on release, ``unexpose`` and ``stop``)."""
        for preview, _host in self._host_previews:
            if slot_id in (None, preview.slot_id) and port in (None, preview.port):
                preview.revoked = True

    def _snap_host(self, snap: Any) -> HostProc:
        if not isinstance(snap, SlotSnapshot):
            raise UsageError(f"expected a SlotSnapshot, got {type(snap).__name__}")
        host = self._snap_hosts.get(snap.snapshot_id)
        if host is None:
            raise UsageError(f"snapshot {snap.snapshot_id} does not belong to this backend")
        return host

    async def _pick(self, profile: str | None) -> HostProc:
        """The live host process with the fewest slots of ``profile`` leased out, among those
        with room (ties: in turn)."""
        name = self.profile(profile).name  # type: ignore[attr-defined]
        hosts = [h for h in await self._started_hosts() if h.alive and name in h.shares]
        if not hosts:
            raise SandboxDiedError(f"profile {name!r}: every host process holding it has exited "
                                   f"({'; '.join(h.gone() for h in self._hosts)})")
        per = self.profiles[name].slots_per_sandbox  # type: ignore[attr-defined]
        turn = next(self._turn)
        return min(hosts, key=lambda h: (h.held.get(name, 0) >= h.shares[name][1] * per, h.held.get(name, 0),
                                         (h.index - turn) % len(hosts)))

    # -- the routed API --------------------------------------------------------------
    async def start(self, profiles_to_start: Sequence[str] | None = None) -> None:
        self._check_open()  # type: ignore[attr-defined]
        if isinstance(profiles_to_start, str):
            raise UsageError(f"profiles_to_start must be a list of profile names, got the string "
                             f"{profiles_to_start!r}; use [{profiles_to_start!r}]")
        names = list(profiles_to_start or ([self.default_profile] if self.default_profile in self.profiles  # type: ignore[attr-defined]
                                           else []))
        for name in names:
            self.profile(name)  # type: ignore[attr-defined]
        hosts = await self._started_hosts()
        await asyncio.gather(*(self._ask(h, "start", [n for n in names if n in h.shares] or None)
                               for h in hosts if any(n in h.shares for n in names)))
        self._started = True

    async def stop(self, purge: bool = False) -> None:
        if self._closed:  # type: ignore[has-type]
            return
        self._check_open()  # type: ignore[attr-defined]
        self._closed = True
        self._revoke_previews()
        if self._hosts_ready is not None:
            await asyncio.gather(self._hosts_ready, return_exceptions=True)
        await asyncio.gather(*self._replacing, return_exceptions=True)
        await asyncio.gather(*(h.close() for h in self._exited), return_exceptions=True)
        await asyncio.gather(*(self._stop_host(h) for h in self._hosts), return_exceptions=True)

    async def _stop_host(self, host: HostProc) -> None:
        if host.alive:
            try:
                await host.request("call", ("stop", (), {}))
            except Exception as exc:  # noqa: BLE001 - stopping goes on; the process is closed next
                log.warning("host process %d: stop failed: %s", host.index, exc)
        await host.close()

    async def _acquire(self, trajectory_id: str | None, profile: str | None,
                       snapshot: SlotSnapshot | None, setup: str | list[str] | None) -> Slot:
        if snapshot is not None or setup or (setup is None and self.profile(profile).setup):  # type: ignore[attr-defined]
            return await super()._acquire(trajectory_id, profile, snapshot, setup)  # type: ignore[misc, no-any-return]
        if trajectory_id is not None and not isinstance(trajectory_id, str):
            raise UsageError(f"trajectory_id must be a string, got {type(trajectory_id).__name__}")
        if profile is not None and not isinstance(profile, str):
            raise UsageError(f"profile must be a profile name (a string), got {profile!r:.80}")
        name = self.profile(profile).name  # type: ignore[attr-defined]
        while True:
            host = await self._pick(name)
            try:
                return await self._ask(host, "acquire", trajectory_id, name)  # type: ignore[no-any-return]
            except SandboxDiedError:
                if host.alive:
                    raise
                # It exited while the lease was being made: another one makes it.

    async def _release(self, slot: Slot, reset_workspace: bool, measure_disk: bool) -> Any:
        host = self._host_of(slot)
        held = slot.state not in (SlotState.AVAILABLE, SlotState.RELEASING)
        self._revoke_previews(slot.slot_id)
        if not host.alive:
            if held:
                host.held[slot.profile] -= 1
                slot.state = SlotState.AVAILABLE
                return None
            raise UsageError(f"slot {slot.slot_id} is not held")
        used = await self._ask(host, "release", slot, reset_workspace, measure_disk=measure_disk)
        if held:
            host.held[slot.profile] -= 1
        return used

    async def execute_batch(self, requests: Sequence[tuple[Slot, str, Mapping[str, Any]]],
                            timeout_s: float | None = None,
                            on_output: Callable[[OutputEvent], Any] | None = None) -> list[ExecutionResult]:
        self._check_open()  # type: ignore[attr-defined]
        results, checked = checked_requests(requests, timeout_s)
        groups: dict[HostProc, tuple[list[int], list[tuple]]] = {}
        for i, slot, tool, args in checked:
            host = slot._sandbox
            group = groups.get(host)
            if group is None:
                if not self._owns(host):
                    results[i] = ExecutionResult.failure(f"slot {slot.slot_id} does not belong to this backend",
                                                         slot.slot_id, "slot_not_held")
                    continue
                group = groups[host] = ([], [])
            group[0].append(i)
            group[1].append(((slot.lease_id, slot.slot_id, slot.profile), tool, args))
        spans = {i: tracing.call_span(requests[i][0], requests[i][1]) for _h, (indices, _) in groups.items()
                 for i in indices} if tracing.active() else {}
        waits = [(host, indices, host.request("batch", (items, timeout_s, on_output is not None),
                                              _relay(indices, on_output)))
                 for host, (indices, items) in groups.items()]
        try:
            await asyncio.wait([f for _h, _i, f in waits])
        except asyncio.CancelledError:
            for host, _i, fut in waits:
                host.cancel(fut)
            for span, _started in spans.values():
                tracing.end_error(span, asyncio.CancelledError("the batch was cancelled"))
            raise
        for _host, indices, fut in waits:
            exc = fut.exception()
            if exc is None:
                for i, fields in zip(indices, fut.result(), strict=True):
                    results[i] = ExecutionResult(*fields)
                continue
            for i in indices:
                slot = requests[i][0]
                if isinstance(exc, wire.HostProcessGone):
                    slot.state, slot.error = SlotState.ERROR, str(exc)
                    results[i] = ExecutionResult.failure(str(exc), slot.slot_id, "sandbox_died")
                else:
                    results[i] = ExecutionResult.failure(f"{type(exc).__name__}: {exc}", slot.slot_id, "lost")
        for i, (span, started) in spans.items():
            tracing.end_call_span(span, started, results[i])
        return results

    async def usage(self, slot: Slot, disk: bool = True) -> Any:
        if not isinstance(slot, Slot):
            raise UsageError(f"usage() takes a Slot, got {type(slot).__name__}")
        self._check_open()  # type: ignore[attr-defined]
        return await self._ask(self._host_of(slot), "usage", slot, disk)

    async def _process_request(self, slot: Slot, action: str, within: float, **fields: Any) -> dict[str, Any]:
        self._check_open()  # type: ignore[attr-defined]
        return await self._ask(self._host_of(slot), "_process_request", slot, action, within, **fields)  # type: ignore[no-any-return]

    def get_status(self) -> dict[str, Any]:
        statuses = [(h, h.status()) for h in self._hosts]
        return merge_statuses(self, statuses)

    def list_profiles(self) -> dict[str, dict[str, Any]]:
        active = set(self.get_status()["active_pools"])
        listed: dict[str, dict[str, Any]] = super().list_profiles()  # type: ignore[misc]
        for name, row in listed.items():
            row["active"] = name in active
        return listed

    async def _pool(self, name: str) -> Any:
        raise ConfigError(f"profile {name!r}: with host_processes={self.host_processes} its pool lives "
                          "in the host processes, not in this one")


class RoutedSnapshot(SlotSnapshot):
    """A snapshot held by a host process, as the caller sees it: its forks are the
    caller's slots, held while their state is a lease's (their records are in the host
    process)."""

    _holds = staticmethod(in_use)


def _relay(indices: list[int], on_output: Callable[[OutputEvent], Any] | None) -> Callable[[Any], None] | None:
    """Events of one host process's part of a batch, with their index in the whole batch."""
    if on_output is None:
        return None

    def relay(event: OutputEvent) -> None:
        try:
            on_output(replace(event, index=indices[event.index]))
        except Exception:  # noqa: BLE001 - as streaming.listener: a callback's failure is logged
            log.exception("on_output callback failed for call %d in slot %s", indices[event.index],
                          event.slot_id)
    return relay
