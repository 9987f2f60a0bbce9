"""Scaling on one machine: slots spread over a pool's live sandboxes (``spread``, default
on; off packs them), the host's per-call bookkeeping bounded, and the host's own event
loops on uvloop when installed (``hermes_modal_tool/loops.py``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections import Counter

import pytest
from support import bash

from hermes_modal_tool import ConfigError, SandboxConfig, loops
from hermes_modal_tool.portal import LoopThread


def per_sandbox(slots) -> list[int]:
    return sorted(Counter(s.sandbox_id for s in slots).values())


async def test_acquire_spreads_slots_over_the_live_sandboxes(make_backend):
    backend = await make_backend(min_sandboxes=3, max_sandboxes=3, slots_per_sandbox=4)
    slots = [await backend.acquire(f"t{i}") for i in range(6)]
    assert per_sandbox(slots) == [2, 2, 2]
    # Give back both slots of one sandbox: the next two acquires go there (it holds fewest).
    emptied = slots[0].sandbox_id
    for s in [s for s in slots if s.sandbox_id == emptied]:
        await backend.release(s)
    again = [await backend.acquire(f"u{i}") for i in range(2)]
    assert [s.sandbox_id for s in again] == [emptied, emptied]
    r = await bash(backend, again[0], "echo ok")
    assert r.output == "ok\n", r


async def test_spread_false_packs_slots_into_one_sandbox(make_backend):
    # The control: the same pool and acquires without spread fill one sandbox first.
    backend = await make_backend(min_sandboxes=3, max_sandboxes=3, slots_per_sandbox=4, spread=False)
    slots = [await backend.acquire(f"t{i}") for i in range(6)]
    assert max(per_sandbox(slots)) == 4, per_sandbox(slots)


async def test_the_call_rate_keeps_counts_not_one_entry_per_call(make_backend):
    # The host's per-call work stays O(1) in memory too: before, every call appended a
    # timestamp that stayed until someone asked for the status (GBs after hours at 20k/s).
    backend = await make_backend(min_sandboxes=1, max_sandboxes=1, slots_per_sandbox=4)
    slots = [await backend.acquire(f"r{i}") for i in range(4)]
    for _ in range(3):
        rs = await backend.execute_batch([(s, "bash", {"command": "true"}) for s in slots for _ in range(25)])
        assert all(r.success for r in rs), rs
    pool = backend._pools[slots[0].profile]
    assert pool.calls_per_second(60) == 300 / 60  # every call counted
    assert len(pool._rate_window) <= 30, len(pool._rate_window)
    assert backend.get_status()["calls_per_second"] == 30.0  # the default 10 s window


def test_spread_is_a_validated_profile_field():
    assert SandboxConfig().spread is True
    assert SandboxConfig(spread="off").spread is False
    with pytest.raises(ConfigError, match="spread"):
        SandboxConfig(spread="sometimes")


# -- uvloop ---------------------------------------------------------------------------------
uvloop = pytest.importorskip("uvloop")  # installed by scripts/setup.sh dev (the uvloop extra)


def kind_of_portal_loop() -> type:
    portal = LoopThread()
    try:
        async def loop_type() -> type:
            return type(asyncio.get_running_loop())
        return portal.run(loop_type(), timeout=10)
    finally:
        portal.close()


def test_the_sync_portal_runs_on_uvloop_when_installed(monkeypatch):
    monkeypatch.delenv(loops.UVLOOP_ENV, raising=False)
    assert kind_of_portal_loop() is uvloop.Loop


@pytest.mark.parametrize("off", ["0", "false", "OFF"])
def test_uvloop_is_turned_off_by_the_environment(monkeypatch, off):
    monkeypatch.setenv(loops.UVLOOP_ENV, off)
    assert loops.loop_kind() == "asyncio"
    assert kind_of_portal_loop() is not uvloop.Loop


def test_the_cli_runs_on_the_same_choice(monkeypatch):
    from hermes_modal_tool.cli._common import run_stoppable

    async def loop_type() -> type:
        return type(asyncio.get_running_loop())
    monkeypatch.delenv(loops.UVLOOP_ENV, raising=False)
    assert run_stoppable(loop_type()) is uvloop.Loop
    monkeypatch.setenv(loops.UVLOOP_ENV, "0")
    assert run_stoppable(loop_type()) is not uvloop.Loop


def test_a_bad_uvloop_setting_is_named(monkeypatch):
    monkeypatch.setenv(loops.UVLOOP_ENV, "maybe")
    with pytest.raises(ConfigError, match=f"{loops.UVLOOP_ENV}='maybe'"):
        loops.new_event_loop()


def test_the_engine_runs_on_uvloop():
    # A fresh process: the local driver's first start (its user-namespace check) on uvloop.
    code = (
        "import asyncio, uvloop\n"
        "from hermes_modal_tool import SandboxConfig, ToolBackend\n"
        "async def main():\n"
        f"    async with ToolBackend(SandboxConfig(name='uv{uuid.uuid4().hex[:8]}', slots_per_sandbox=1)) as b:\n"
        "        s = await b.acquire('uv')\n"
        "        r = await b.execute(s, 'bash', {'command': 'echo hi'})\n"
        "        print(type(asyncio.get_running_loop()).__name__, r.output, r.error, end='')\n"
        "uvloop.run(main())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout == "Loop hi\n None", (out.stdout, out.stderr[-2000:])
