"""Faults of the Modal driver, injected through the local Modal control plane.

Modal ends a sandbox mid-batch (each reason Modal reports), refuses creations with
its rate-limit error, does not know a secret, fails an image build, rejects the
credentials; and the process that owns sandboxes is killed with -9, after which
``hermes-modal-tool modal gc`` must find and terminate what it left.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import on_server, running_sandboxes
from support import SMALL, bash

from hermes_modal_tool import CredentialsError, SandboxStartError, SecretNotFoundError
from hermes_modal_tool.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def modal_backend(make_backend, modal_server, request):
    """``make_backend`` on the Modal driver; afterwards no sandbox of it may run."""
    made = []

    async def build(**fields):
        backend = await make_backend(**{**SMALL, "driver": "modal", **fields})
        made.append(backend)
        return backend

    yield build
    for backend in made:
        make_backend.note(backend)
        await asyncio.wait_for(backend.stop(), 60)
        for name in backend.profiles:
            assert not running_sandboxes(modal_server, name)


@pytest.mark.parametrize("status, words", [
    ("timeout", "timeout (max_lifetime"),
    ("idle_timeout", "idle_timeout"),
    ("preempted", "internal failure or preemption"),
    ("terminated", "was terminated"),
])
async def test_modal_ending_a_sandbox_mid_batch_fails_its_calls_with_the_reason(
        modal_backend, modal_server, status, words):
    backend = await modal_backend(slots_per_sandbox=1, min_sandboxes=2, max_sandboxes=2,
                                  execution_timeout_s=60)
    a = await backend.acquire("victim")
    other = await backend.acquire("bystander")  # in the other sandbox
    victim_id = next(r.sandbox_id for r in running_sandboxes(modal_server, backend.default_profile)
                     if r.tags["hmt-sandbox"] == a.slot_id.rsplit("_slot_", 1)[0])
    batch = asyncio.ensure_future(backend.execute_batch([
        (a, "bash", {"command": "sleep 30"}), (other, "bash", {"command": "sleep 2; echo fine"})]))
    await asyncio.sleep(0.5)
    t0 = time.monotonic()
    await on_server(modal_server, modal_server.terminate_sandbox(victim_id, status=status))
    ra, rb = await asyncio.wait_for(batch, 15)
    assert not ra.success and words in ra.error and victim_id in ra.error, ra.error
    assert rb.success and rb.output == "fine\n", rb
    assert time.monotonic() - t0 < 5
    await backend.release(a)
    fresh = await backend.acquire("next")
    assert (await bash(backend, fresh, "echo replaced")).output == "replaced\n"


@pytest.mark.parametrize("fault, expected", [
    # Two rate-limit refusals: retried after a lookup by tag finds nothing.
    (lambda server: server.fail_next_creates(2), {"create_retries": 2, "created": 1}),
    # Four lost replies: the SDK's three retries all fail too, so the driver sees an
    # error although the sandbox exists; it finds it by its create tag.
    (lambda server: server.lose_create_replies(4), {"adopted_after_error": 1, "create_retries": 0}),
], ids=["rate-limited", "reply-lost"])
async def test_failed_creates_end_with_exactly_one_sandbox(modal_backend, modal_server, fault, expected):
    fault(modal_server)
    backend = await modal_backend(min_sandboxes=1, max_sandboxes=1)
    stats = backend.get_status()["drivers"]["modal"]
    assert {k: stats[k] for k in expected} == expected
    assert len(running_sandboxes(modal_server, backend.default_profile)) == 1
    slot = await backend.acquire("after-the-fault")
    assert (await bash(backend, slot, "echo ok")).output == "ok\n"


async def test_an_unknown_secret_is_a_clear_error(modal_backend):
    with pytest.raises(SecretNotFoundError) as err:
        await modal_backend(secrets=["no-such-secret"])
    text = str(err.value)
    assert "no-such-secret" in text and "modal secret create" in text


async def test_a_failed_image_build_is_a_clear_error(modal_backend, modal_server):
    modal_server.fail_image_builds("broken-image")
    with pytest.raises(SandboxStartError) as err:
        await modal_backend(image="example.invalid/broken-image:1")
    text = str(err.value)
    assert "broken-image" in text and "could not be built" in text


async def test_rejected_credentials_name_their_source_not_the_secret(modal_backend, monkeypatch):
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-wrong-secret-value")
    with pytest.raises(CredentialsError) as err:
        await modal_backend()
    text = str(err.value)
    assert "MODAL_TOKEN_ID and MODAL_TOKEN_SECRET environment variables" in text
    assert "as-wrong-secret-value" not in text and "modal token new" in text


OWNER = textwrap.dedent("""
    import asyncio, sys
    from hermes_modal_tool import SandboxConfig, ToolBackend

    async def main():
        backend = ToolBackend(SandboxConfig(name=sys.argv[1], driver="modal", slots_per_sandbox=2,
                                            min_sandboxes=2, max_sandboxes=2,
                                            heartbeat_timeout=float(sys.argv[2])))
        await backend.start()
        slot = await backend.acquire("doomed")
        await backend.execute_batch([(slot, "bash", {"command": "sleep 600 &"})])
        print("ready", flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
""")


async def test_modal_gc_terminates_what_a_killed_owner_left(modal_server, make_backend):
    profile = "crash" + os.urandom(3).hex()
    owner = await asyncio.create_subprocess_exec(
        sys.executable, "-c", OWNER, profile, "60", stdout=subprocess.PIPE, env={**os.environ}, cwd=ROOT)
    try:
        line = await asyncio.wait_for(owner.stdout.readline(), 60)
        assert line.strip() == b"ready"
        assert len(running_sandboxes(modal_server, profile)) == 2
        # A live owner's sandboxes are not touched.
        result = await asyncio.to_thread(CliRunner().invoke, cli_main, ["modal", "gc"])
        assert result.exit_code == 0, result.output
        assert len(running_sandboxes(modal_server, profile)) == 2
    finally:
        owner.send_signal(signal.SIGKILL)
        await owner.wait()
    assert len(running_sandboxes(modal_server, profile)) == 2  # a crash leaves them running
    dry = await asyncio.to_thread(CliRunner().invoke, cli_main, ["modal", "gc", "--dry-run"])
    assert dry.exit_code == 0 and dry.output.count("listed (dry run)") >= 2, dry.output
    result = await asyncio.to_thread(CliRunner().invoke, cli_main,
                                     ["modal", "gc", "--app", f"hermes-modal-tool-{profile}"])
    assert result.exit_code == 0, result.output
    assert result.output.count("terminated") >= 2, result.output
    assert running_sandboxes(modal_server, profile) == []
    for record in modal_server.sandboxes.values():
        if record.tags.get("hmt-profile") == profile:
            assert record.live_execs == 0



async def test_modal_sandboxes_of_a_killed_owner_end_themselves(modal_server):
    """No ``modal gc``: the owner heartbeats on the agent's stream; once it is killed with
    -9 nothing marks the sandbox's heartbeat file and its watchdog (PID 1) ends it within
    ``heartbeat_timeout`` plus 10 s."""
    profile = "orphan" + os.urandom(3).hex()
    heartbeat_timeout = 6.0
    owner = await asyncio.create_subprocess_exec(
        sys.executable, "-c", OWNER, profile, str(heartbeat_timeout), stdout=subprocess.PIPE,
        env={**os.environ}, cwd=ROOT)
    try:
        line = await asyncio.wait_for(owner.stdout.readline(), 60)
        assert line.strip() == b"ready"
        await asyncio.sleep(2 * heartbeat_timeout)  # a live owner's sandboxes stay up
        assert len(running_sandboxes(modal_server, profile)) == 2
    finally:
        owner.send_signal(signal.SIGKILL)
        await owner.wait()
    killed = time.monotonic()
    while running_sandboxes(modal_server, profile):
        assert time.monotonic() - killed < heartbeat_timeout + 10, "sandboxes outlived their owner"
        await asyncio.sleep(0.5)
    ours = [r for r in modal_server.sandboxes.values() if r.tags.get("hmt-profile") == profile]
    assert len(ours) == 2 and all(r.status == "finished" for r in ours), ours
    # The server marks a sandbox finished first, then kills its execs and waits for them.
    while any(r.live_execs for r in ours):
        assert time.monotonic() - killed < heartbeat_timeout + 20, f"execs outlived their sandbox: {ours}"
        await asyncio.sleep(0.2)
