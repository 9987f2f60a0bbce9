"""Fixtures for the attack suite: two slots of one sandbox, host-side views of a slot."""

from __future__ import annotations

import pytest
from support import bash

from .helpers import SandboxView


@pytest.fixture
async def two_slots(backend):
    """Two slots of the same sandbox; ``a`` holds a secret file, ``b`` is the attacker."""
    a = await backend.acquire("victim")
    b = await backend.acquire("attacker")
    assert a.sandbox_id == b.sandbox_id and a.workspace_dir != b.workspace_dir
    r = await bash(backend, a, "echo victim-secret > secret.txt; mkdir d; echo x > d/f")
    assert r.success
    return a, b




#: Where slots run: locally; on Modal (the local control plane) with bwrap in the image;
#: on Modal without it (each slot only has its own uid, 0700 workspace and session).
MODES = {"local": {}, "modal": {"driver": "modal"},
         "modal-nobwrap": {"driver": "modal", "env_vars": {
             "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}}}


@pytest.fixture(params=list(MODES))
async def mode_backend(request, make_backend):
    """A backend factory for each mode of :data:`MODES`; ``stop()`` leaves no Modal
    sandbox running. ``mode_backend.mode`` names the mode and ``mode_backend.view`` is a
    :class:`helpers.SandboxView` (where a sandbox's paths are on this host)."""
    server = request.getfixturevalue("modal_server") if request.param != "local" else None
    made = []

    async def build(**fields):
        backend = await make_backend(**{**fields, **MODES[request.param]})
        made.append(backend)
        isolation = backend.get_status()["pools"][backend.default_profile]["isolation"]
        assert isolation == ("none" if request.param == "modal-nobwrap" else "bwrap"), isolation
        return backend

    build.mode = request.param
    build.view = SandboxView(server)
    yield build
    for backend in made:
        make_backend.note(backend)
        await backend.stop()
