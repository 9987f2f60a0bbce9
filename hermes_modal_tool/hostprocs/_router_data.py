"""The router's snapshots, transfers and previews (routed to the host process holding
their slot or snapshot), how profiles are shared out, and the merged status."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import SandboxDiedError, UsageError
from ..previews import Preview
from ..sandbox_images import use_image
from ..slots import Slot
from ..snapshots import SlotSnapshot
from ..transfer import import_pieces
from . import wire

if TYPE_CHECKING:
    from ..config import SandboxConfig
    from .host import HostProc


def split_shares(profiles: Mapping[str, SandboxConfig], k: int) -> list[dict[str, tuple[int, int]]]:
    """Each host process's ``(min_sandboxes, max_sandboxes)`` of each profile: as even as
    whole sandboxes allow, the first processes taking the remainder; a process with no
    sandbox of any profile is not started (so there are at most max(max_sandboxes) of them).
    ``k``: checked by ``resolve_host_processes``.
    """
    shares: list[dict[str, tuple[int, int]]] = [{} for _ in range(k)]
    for name, cfg in profiles.items():
        for i in range(k):
            most = cfg.max_sandboxes // k + (i < cfg.max_sandboxes % k)
            if most:
                shares[i][name] = (cfg.min_sandboxes // k + (i < cfg.min_sandboxes % k), most)
    return [s for s in shares if s]


#: Pool status keys that are the profile's settings (taken from the router's profiles),
#: not counts to add up over the host processes.
_SETTINGS = ("min_sandboxes", "max_sandboxes", "slots_per_sandbox")


def _merge(values: list[Any]) -> Any:
    """Counts added up, lists joined, mappings merged key by key; anything else: the first."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    first = present[0]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        total = sum(present)
        return round(total, 2) if isinstance(total, float) else total
    if all(isinstance(v, list) for v in present):
        return [x for v in present for x in v]
    if all(isinstance(v, dict) for v in present):
        keys = list(dict.fromkeys(k for v in present for k in v))
        return {k: _merge([v.get(k) for v in present]) for k in keys}
    return first


def merge_statuses(router: Any, statuses: list[tuple[HostProc, dict[str, Any] | None]]) -> dict[str, Any]:
    """``get_status()`` of a split backend: the host processes' statuses merged (see
    ``ToolBackend.get_status``), with ``host_processes``: each one's ``index``, ``pid``,
    ``alive``, ``held_slots``, ``drivers`` and ``error`` (why it exited or gave no status)."""
    got = [s for _h, s in statuses if s]
    pools: dict[str, Any] = {}
    for name in dict.fromkeys(n for s in got for n in s.get("pools", {})):
        merged = _merge([s["pools"].get(name) for s in got])
        for key in _SETTINGS:
            merged[key] = getattr(router.profiles[name], key)
        pools[name] = merged
    keys = ("sandboxes", "healthy_sandboxes", "total_slots", "available_slots", "acquired_slots",
            "waiting_acquires", "calls", "failures", "timeouts", "quarantined", "network_refused",
            "calls_per_second", "quarantined_slots", "snapshots", "setups")
    main = router.profiles.get(router.default_profile) or next(iter(router.profiles.values()))
    return {
        **{k: _merge([s.get(k) for s in got]) if got else 0 for k in keys},
        "max_sandboxes": sum(p.max_sandboxes for p in router.profiles.values()),
        "slots_per_sandbox": main.slots_per_sandbox,
        "default_profile": router.default_profile,
        "profiles": list(router.profiles),
        "active_pools": list(dict.fromkeys(n for s in got for n in s.get("active_pools", []))),
        "drivers": _merge([s.get("drivers") for s in got]) or {},
        "closed": router._closed,
        "pools": pools,
        "host_processes": [{"index": h.index, "pid": h.pid, "alive": h.alive, "held_slots": dict(h.held),
                            "drivers": (s or {}).get("drivers", {}),
                            "error": None if s else (h.gone() if not h.alive else "no status")}
                           for h, s in statuses],
    }


class RouterData:
    """Snapshots, transfers and previews of a split backend (mixed in with HostRouter)."""

    _ask: Any
    _host_of: Any
    _snap_host: Any
    _pick: Any
    _check_open: Any
    _hosts: list[HostProc]
    _host_previews: list[tuple[Preview, HostProc]]
    _revoke_previews: Any

    async def snapshot(self, slot: Slot) -> SlotSnapshot:
        if not isinstance(slot, Slot):
            raise UsageError(f"snapshot() takes a Slot, got {type(slot).__name__}")
        self._check_open()
        return await self._ask(self._host_of(slot), "snapshot", slot)  # type: ignore[no-any-return]

    async def fork(self, slot_or_snapshot: Slot | SlotSnapshot, n: int,
                   trajectory_ids: list[str] | None = None) -> list[Slot]:
        self._check_open()
        if isinstance(slot_or_snapshot, Slot):
            host = self._host_of(slot_or_snapshot)
        else:
            host = self._snap_host(slot_or_snapshot)
        slots: list[Slot] = await self._ask(host, "fork", slot_or_snapshot, n, trajectory_ids)
        if isinstance(slot_or_snapshot, SlotSnapshot):
            slot_or_snapshot._forks.extend(weakref.ref(s) for s in slots)
        return slots

    async def setup_snapshot(self, setup: str | list[str], profile: str | None = None) -> SlotSnapshot:
        self._check_open()
        return await self._ask(await self._pick(profile), "setup_snapshot", setup, profile)  # type: ignore[no-any-return]

    async def release_snapshot(self, snapshot: SlotSnapshot) -> None:
        self._check_open()
        host = self._snap_host(snapshot)
        if snapshot.released:  # releasing twice is fine (as ToolBackend's)
            return
        if host.alive:
            await self._ask(host, "release_snapshot", snapshot)
        snapshot.released = True

    def export_snapshot(self, snapshot: SlotSnapshot) -> AsyncIterator[bytes]:
        self._check_open()
        return self._export(self._snap_host(snapshot), snapshot)

    async def _export(self, host: HostProc, snapshot: SlotSnapshot) -> AsyncIterator[bytes]:
        items: asyncio.Queue = asyncio.Queue()
        done = host.request("call", ("export_snapshot", (wire.SnapRef(snapshot.snapshot_id),), {}),
                            items=items)
        try:
            while True:
                item = await items.get()
                if item is wire.END:
                    break
                if isinstance(item, wire.HostProcessGone):
                    raise SandboxDiedError(str(item))
                host.send(0, "credit", done.rid)  # type: ignore[attr-defined]
                yield item
            await done  # raises what the export raised there
        finally:
            if not done.done():
                host.cancel(done)

    async def import_snapshot(self, data: bytes | Iterable[bytes] | AsyncIterable[bytes],
                              profile: str | None = None) -> SlotSnapshot:
        self._check_open()
        host = await self._pick(profile)
        fut = host.request("call", ("import_snapshot", (wire.ChunksRef(), profile), {}))
        rid = fut.rid  # type: ignore[attr-defined]
        credit = host.credit_for(rid)
        try:
            async for piece in import_pieces(data):
                await credit.acquire()
                if fut.done():
                    break
                host.send(0, "chunk", (rid, bytes(piece)))
            host.send(0, "chunk", (rid, None))
            try:
                value, _touched = await fut
            except wire.HostProcessGone as exc:
                raise SandboxDiedError(str(exc)) from None
        except BaseException:
            host.cancel(fut)
            raise
        return self._unpack(host, value)  # type: ignore[attr-defined, no-any-return]

    async def snapshot_sandbox(self, profile: str | None = None, setup: str | list[str] | None = None,
                               *, use: bool = True, timeout_s: int = 600) -> str:
        self._check_open()
        host = await self._pick(profile)
        image: str = await self._ask(host, "snapshot_sandbox", profile, setup, use=use, timeout_s=timeout_s)
        if use:
            name = self.profile(profile).name  # type: ignore[attr-defined]
            use_image(self, name, image)  # type: ignore[arg-type]  # the router's profiles (it has no pools)
            await asyncio.gather(*(self._ask(h, "use_image", name, image) for h in self._hosts
                                   if h is not host and h.alive))
        return image

    async def _upload(self, slot: Slot, local: Any, remote_path: str, offset: int, resume: bool) -> Any:
        """As ToolBackend's; a file object (not a path or bytes) is first copied to a
        temporary file, which the host process holding the slot reads."""
        host = self._host_of(slot)
        if isinstance(local, (str, os.PathLike, bytes, bytearray, memoryview)) or not hasattr(local, "read"):
            return await self._ask(host, "upload", slot, _portable_local(local), remote_path, offset, resume)
        with tempfile.NamedTemporaryFile(prefix="hmt-upload-") as spool:
            if offset and hasattr(local, "seek"):
                local.seek(0)
            await asyncio.to_thread(shutil.copyfileobj, local, spool)
            spool.flush()
            return await self._ask(host, "upload", slot, spool.name, remote_path, offset, resume)

    async def _download(self, slot: Slot, remote_path: str, local: Any, offset: int, resume: bool) -> Any:
        """As ToolBackend's; into a file object through a temporary file (which the host
        process holding the slot writes)."""
        host = self._host_of(slot)
        if isinstance(local, (str, os.PathLike)) or not hasattr(local, "write"):
            return await self._ask(host, "download", slot, remote_path, local, offset, resume)
        with tempfile.NamedTemporaryFile(prefix="hmt-download-") as spool:
            if offset:
                local.seek(0)
                await asyncio.to_thread(_copy_bytes, local, spool, offset)
                spool.flush()
            moved = await self._ask(host, "download", slot, remote_path, spool.name, offset, resume)
            spool.seek(offset)
            local.seek(offset)
            await asyncio.to_thread(shutil.copyfileobj, spool, local)
            await asyncio.to_thread(local.flush)
            return moved

    async def expose(self, slot: Slot, port: int, *, host: str = "127.0.0.1", listen_port: int = 0) -> Preview:
        self._check_open()
        return await self._ask(self._host_of(slot), "expose", slot, port, host=host,  # type: ignore[no-any-return]
                               listen_port=listen_port)

    async def unexpose(self, target: Slot | Preview, port: int | None = None) -> int:
        self._check_open()
        if isinstance(target, Preview):
            hosts = [h for p, h in self._host_previews if p is target]
            if not hosts:
                return 0
            count: int = await self._ask(hosts[0], "unexpose", target, port)
            target.revoked = True
            return count
        if not isinstance(target, Slot):
            raise UsageError(f"unexpose() takes a Slot or a Preview, got {type(target).__name__}")
        count = await self._ask(self._host_of(target), "unexpose", target, port)
        self._revoke_previews(target.slot_id, port)
        return count


def _portable_local(local: Any) -> Any:
    if isinstance(local, (bytearray, memoryview)):
        return bytes(local)
    if isinstance(local, os.PathLike):
        return os.fspath(local)
    return local


def _copy_bytes(src: Any, dst: Any, n: int) -> None:
    while n:
        piece = src.read(min(n, 1 << 20))
        if not piece:
            return
        dst.write(piece)
        n -= len(piece)
