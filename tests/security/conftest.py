"""Fixtures for the attack suite: two slots of one sandbox, host-side views of a slot."""

from __future__ import annotations

import pytest
from support import bash


@pytest.fixture
async def two_slots(backend):
    """Two slots of the same sandbox; ``a`` holds a secret file, ``b`` is the attacker."""
    a = await backend.acquire("victim")
    b = await backend.acquire("attacker")
    assert a.sandbox_id == b.sandbox_id and a.workspace_dir != b.workspace_dir
    r = await bash(backend, a, "echo victim-secret > secret.txt; mkdir d; echo x > d/f")
    assert r.success
    return a, b


