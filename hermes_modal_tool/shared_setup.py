"""Shared setup keyed by content: run a task's setup once, start every slot from its snapshot.

The key is a hash of the setup commands, the profile's name and its image (like rLLM's
``env_key``): two requests with the same key share one run and one snapshot, whatever
their trajectory. Concurrent first requests for a key wait for the one run; a failed
setup fails each of its waiters with :class:`~hermes_modal_tool.errors.SetupError`
(carrying what it printed) and is not cached, so the next request runs it again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .errors import SetupError, UsageError

if TYPE_CHECKING:
    from ._backend_view import BackendView
    from .snapshots import SlotSnapshot

#: Seconds each setup command may run.
SETUP_COMMAND_TIMEOUT_S = 1800.0


def setup_key(commands: Sequence[str], profile: str, image: str | None) -> str:
    """The content key of a setup: sha256 of the commands, the profile and its image (hex)."""
    doc = json.dumps({"commands": list(commands), "profile": profile, "image": image}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()


def check_commands(commands: Any, where: str) -> list[str]:
    if isinstance(commands, str):
        commands = [commands]
    if (not isinstance(commands, Sequence) or not commands
            or not all(isinstance(c, str) and c.strip() for c in commands)):
        raise UsageError(f"{where}: setup must be a command or a non-empty list of commands "
                         f"(strings), got {commands!r:.120}")
    return list(commands)


class SharedSetups:
    """A backend's setups by key: the snapshot of each that succeeded, the one running."""

    def __init__(self, backend: BackendView) -> None:
        self.backend = backend
        self.done: dict[str, SlotSnapshot] = {}
        self.running: dict[str, asyncio.Task] = {}
        self.stats: dict[str, dict[str, Any]] = {}

    async def snapshot_for(self, commands: Sequence[str], profile: str | None) -> SlotSnapshot:
        """The snapshot of ``commands`` run in a fresh slot of ``profile`` (run once per key).

        Raises:
            SetupError: the setup failed (``output`` holds what it printed).
        """
        cfg = self.backend.profile(profile)
        commands = check_commands(commands, "setup")
        key = setup_key(commands, cfg.name, cfg.image)
        snap = self.done.get(key)
        if snap is not None and not snap.released:
            return snap
        task = self.running.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._run(key, commands, cfg.name),
                                                          name=f"hermes-modal-tool setup {key[:12]}")
            self.running[key] = task
            task.add_done_callback(lambda t, key=key: self._finished(key, t))
        return await asyncio.shield(task)

    def _finished(self, key: str, task: asyncio.Task) -> None:
        if self.running.get(key) is task:
            del self.running[key]
        if not task.cancelled() and task.exception() is None:
            self.done[key] = task.result()

    async def _run(self, key: str, commands: list[str], profile: str) -> SlotSnapshot:
        entry = self.stats.setdefault(key, {"runs": 0, "failures": 0, "profile": profile})
        entry["runs"] += 1
        started = time.monotonic()
        slot = await self.backend.acquire(f"setup-{key[:12]}", profile, setup=[])  # not the profile's
        try:
            outputs = []
            for i, command in enumerate(commands):
                r = await self.backend.execute(slot, "bash", {"command": command,
                                                              "timeout": SETUP_COMMAND_TIMEOUT_S})
                outputs.append(r.output)
                if not r.success:
                    entry["failures"] += 1
                    output = "".join(outputs)
                    raise SetupError(
                        f"setup {key[:12]} failed at command {i + 1} of {len(commands)} "
                        f"({command[:80]!r}): exit {r.returncode}"
                        + (f": {r.error}" if r.error else "") + f"; output:\n{output[-4000:]}",
                        output=output, returncode=r.returncode)
            snap = await self.backend.snapshot(slot)
        finally:
            await self.backend.release(slot)
        entry["seconds"] = round(time.monotonic() - started, 3)
        entry["snapshot"] = snap.snapshot_id
        return snap

    async def close(self) -> None:
        for task in list(self.running.values()):
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)

    def status(self) -> dict[str, dict[str, Any]]:
        return {key[:16]: dict(v) for key, v in self.stats.items()}
