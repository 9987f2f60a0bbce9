"""One slot per conversation key (LangChain thread, OpenAI conversation, Hermes task).

The adapters share this map from a key to the slot that key holds; it holds no
pool logic (the backend's pools do that). A key keeps its slot, so `cd` and files
persist across tool calls, until :meth:`SlotSessions.close` or until it has been
idle for ``lifetime_s``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .backend import ToolBackend
from .slots import ExecutionResult, Slot, SlotState


@dataclass
class _Session:
    slot: Slot
    profile: str | None
    last_used: float


class SlotSessions:
    """Map conversation keys to slots of one backend.

    Args:
        backend: the engine.
        lifetime_s: release a key's slot after this many idle seconds (None: never).
    """

    def __init__(self, backend: ToolBackend, lifetime_s: float | None = None) -> None:
        self.backend = backend
        self.lifetime_s = lifetime_s
        self._sessions: dict[str, _Session] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def slot(self, key: str, profile: str | None = None) -> Slot:
        """The slot ``key`` holds, acquiring one (from ``profile``) on first use.

        A key whose slot was lost (its sandbox died) or that asks for another profile
        gets a new slot; nothing is re-run in it.
        """
        await self.expire_idle()
        wanted = self.backend.profile(profile).name if profile is not None else None  # ConfigError first
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            session = self._sessions.get(key)
            if session is not None and (session.slot.state is SlotState.ERROR
                                        or (wanted is not None and wanted != session.slot.profile)):
                await self._drop(key)
                session = None
            if session is None:
                slot = await self.backend.acquire(trajectory_id=key, profile=profile)
                session = self._sessions[key] = _Session(slot, profile, time.monotonic())
            session.last_used = time.monotonic()
            return session.slot

    async def execute(self, key: str, tool: str, args: Mapping[str, Any], *,
                      timeout_s: float | None = None, profile: str | None = None,
                      on_output: Any = None) -> ExecutionResult:
        """Run one tool call in ``key``'s slot (never retried); ``on_output``: as
        :meth:`ToolBackend.execute`."""
        slot = await self.slot(key, profile)
        try:
            return await self.backend.execute(slot, tool, args, timeout_s, on_output)
        finally:
            session = self._sessions.get(key)
            if session is not None:
                session.last_used = time.monotonic()

    async def execute_many(self, key: str, calls: list[tuple[str, Mapping[str, Any]]], *,
                           timeout_s: float | None = None,
                           profile: str | None = None) -> list[ExecutionResult]:
        """Run several calls in ``key``'s slot, in order, as one batch."""
        slot = await self.slot(key, profile)
        return await self.backend.execute_batch([(slot, tool, args) for tool, args in calls], timeout_s)

    async def close(self, key: str) -> bool:
        """Release ``key``'s slot (its workspace is emptied). Returns whether it had one."""
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            return await self._drop(key)

    async def _drop(self, key: str) -> bool:
        session = self._sessions.pop(key, None)
        if session is None:
            return False
        if session.slot.state is not SlotState.ERROR:
            await self.backend.release(session.slot, reset_workspace=True)
        return True

    async def close_all(self) -> int:
        """Release every key's slot; return how many were released."""
        keys = list(self._sessions)
        await asyncio.gather(*(self.close(k) for k in keys), return_exceptions=True)
        return len(keys)

    async def expire_idle(self) -> None:
        if self.lifetime_s is None:
            return
        now = time.monotonic()
        stale = [k for k, s in self._sessions.items()
                 if now - s.last_used > self.lifetime_s and not self._locks[k].locked()]
        for key in stale:
            await self.close(key)

    def info(self) -> dict[str, dict[str, Any]]:
        """Per key: slot id, workspace, profile, seconds idle."""
        now = time.monotonic()
        return {k: {"slot_id": s.slot.slot_id, "workspace": s.slot.workspace_dir,
                    "profile": s.slot.profile, "idle_s": round(now - s.last_used, 3),
                    "state": s.slot.state.value}
                for k, s in self._sessions.items()}

    def slots(self) -> dict[str, Slot]:
        """Each key's slot (a snapshot)."""
        return {k: s.slot for k, s in self._sessions.items()}

    def __contains__(self, key: object) -> bool:
        return key in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)
