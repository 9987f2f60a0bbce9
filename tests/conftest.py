"""Shared fixtures: real local sandboxes (bubblewrap), small sizes, always stopped.

``make_backend(**config_fields)`` builds a ``ToolBackend(SandboxConfig(...))`` with
small defaults, starts it, and stops it when the test ends; then it checks that
nothing was left behind: no agent, ``bwrap`` or slot process and no state
directory (``/tmp/hermes-modal-tool-*``, ``/dev/shm/hermes-modal-tool-*``) of
those backends. Leftovers are told apart from other programs' sandboxes (see
``support.Leftovers``), so the check holds while another suite runs too.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support import SMALL, Leftovers, describe

from hermes_modal_tool import SandboxConfig, Slot, ToolBackend


class BackendFactory:
    """Makes started backends with small defaults; stops them all at the end."""

    def __init__(self, leftovers: Leftovers) -> None:
        self.leftovers = leftovers
        self.made: list[ToolBackend] = []
        self.profile_name = "t" + uuid.uuid4().hex[:8]

    async def __call__(self, *, config: SandboxConfig | None = None,
                       profiles: dict[str, SandboxConfig] | None = None,
                       default_profile: str | None = None, start: bool = True,
                       **fields: Any) -> ToolBackend:
        """A backend: ``config=``, or ``profiles=`` (+ ``default_profile=``), or
        ``SandboxConfig(**SMALL | fields)``; started unless ``start=False``."""
        tag = self.leftovers.tag
        if profiles is not None:
            backend = ToolBackend(profiles={n: tag(c) for n, c in profiles.items()},
                                  default_profile=default_profile)
        else:
            # A profile name of its own: sandbox ids (and so cgroup names) do not
            # collide with sandboxes another program runs on this machine.
            fields.setdefault("name", self.profile_name)
            backend = ToolBackend(tag(config or SandboxConfig(**{**SMALL, **fields})))
        return await self.adopt(backend, start=start)

    async def adopt(self, backend: ToolBackend, start: bool = False) -> ToolBackend:
        """Stop (and check) a backend the test built itself at the end of the test."""
        self.made.append(backend)
        if start:
            await backend.start()
        return backend

    def note(self, backend: ToolBackend) -> None:
        """Remember what a backend created; call before a test stops it itself."""
        self.leftovers.note_roots(backend)

    async def close(self) -> None:
        for backend in self.made:
            self.leftovers.note_roots(backend)
        for backend in self.made:
            await asyncio.wait_for(backend.stop(), 30)


@pytest.fixture
async def make_backend() -> AsyncIterator[BackendFactory]:
    leftovers = Leftovers(uuid.uuid4().hex)
    factory = BackendFactory(leftovers)
    try:
        yield factory
    finally:
        await factory.close()
    procs, dirs = await leftovers.remaining()
    assert not procs, f"processes left behind after stop(): {describe(procs)}"
    assert not dirs, f"state directories left behind after stop(): {sorted(dirs)}"


@pytest.fixture
async def backend(make_backend: BackendFactory) -> ToolBackend:
    """A started backend with the small defaults (2 slots per sandbox, up to 2 sandboxes)."""
    return await make_backend()


@pytest.fixture
async def slot(backend: ToolBackend) -> Slot:
    """A slot held by trajectory ``"traj-test"`` in ``backend``."""
    return await backend.acquire("traj-test")
