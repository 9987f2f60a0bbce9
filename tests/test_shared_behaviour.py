"""The engine's behaviour, once per driver: one suite, parametrized by ``driver``
(and once more on the local driver over two host processes, ``local-hosts``).

``local`` runs slots in bubblewrap on this host; ``modal`` runs the same engine
through the Modal driver and the real ``modal`` SDK against the package's local
Modal control plane (``hermes_modal_tool.testing.modal_server``). What a slot can
see, what persists, how timeouts, the output cap, parallel batches, a sandbox's
death and secrets behave must not depend on the driver.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from conftest import on_server, running_sandboxes
from support import SMALL, agent_processes, bash, eventually

from hermes_modal_tool import SandboxConfig


@pytest.fixture(params=["local", "modal", "local-hosts"])
def driver(request: pytest.FixtureRequest) -> str:
    """conftest's drivers, and the local driver over two host processes (``local-hosts``):
    the behaviour must not depend on ``host_processes`` either."""
    if request.param == "modal":
        request.getfixturevalue("modal_server")
    return str(request.param)


async def test_slots_cannot_see_each_others_files_or_processes(driver_backend):
    backend = await driver_backend(slots_per_sandbox=2, max_sandboxes=1)
    a = await backend.acquire("traj-a")
    b = await backend.acquire("traj-b")
    ra = await bash(backend, a, "echo private-a > mine.txt; (setsid sleep 300 &); echo started")
    assert ra.success, ra
    path = f"{a.workspace_dir}/mine.txt"
    rb = await bash(backend, b, f"cat {path}; ls {os.path.dirname(a.workspace_dir)}; "
                                f"ps -eo args; echo mine-b > mine.txt; cat mine.txt")
    assert "private-a" not in rb.output
    assert "sleep 300" not in rb.output
    assert "mine-b" in rb.output
    ra2 = await bash(backend, a, "cat mine.txt")
    assert ra2.output == "private-a\n"


async def test_host_home_and_environment_are_invisible(driver_backend, monkeypatch):
    canary_value = "canary-" + secrets.token_hex(8)
    monkeypatch.setenv("HMT_HOST_ENV_CANARY", canary_value)
    home = Path.home()
    canary = home / f".hmt-home-canary-{secrets.token_hex(4)}"
    await asyncio.to_thread(canary.write_text, canary_value)
    try:
        backend = await driver_backend()
        slot = await backend.acquire("snoop")
        r = await bash(backend, slot, f"env; cat {canary} 2>&1; "
                                      "cat /proc/1/environ 2>/dev/null | tr '\\0' '\\n'")
        listing = await bash(backend, slot, f"ls -a {home} 2>&1")
    finally:
        canary.unlink()
    assert canary_value not in r.output
    assert "No such file" in r.output
    assert canary.name not in listing.output


async def test_cd_and_export_persist_between_calls(driver_backend):
    backend = await driver_backend()
    slot = await backend.acquire("persist")
    r1 = await bash(backend, slot, "mkdir -p sub/dir && cd sub/dir && export GREETING=hello-$((6*7))")
    assert r1.success and r1.metadata["returncode"] == 0
    r2 = await bash(backend, slot, 'pwd; echo "$GREETING"; f() { echo fn-ok; }')
    assert r2.output == f"{slot.workspace_dir}/sub/dir\nhello-42\n"
    r3 = await bash(backend, slot, "f")
    assert r3.output == "fn-ok\n"


async def test_timeout_returns_124_keeps_output_and_the_shell(driver_backend):
    backend = await driver_backend()
    slot = await backend.acquire("slow")
    await bash(backend, slot, "cd /tmp")
    r = await bash(backend, slot, "echo before; sleep 30; echo never", timeout=1)
    assert not r.success
    assert r.metadata["returncode"] == 124
    assert "before" in r.output and "never" not in r.output
    after = await bash(backend, slot, "echo after; pwd")
    assert after.output == "after\n/tmp\n"


async def test_output_is_capped_with_head_tail_and_a_marker(driver_backend):
    backend = await driver_backend(output_limit=1000)
    slot = await backend.acquire("flood")
    r = await bash(backend, slot, "echo HEAD; head -c 300000 /dev/zero | tr '\\0' x; echo; echo TAIL")
    assert r.success
    assert r.output.startswith("HEAD") and r.output.rstrip().endswith("TAIL")
    assert "[output truncated:" in r.output
    assert len(r.output) < 1200
    assert r.metadata.get("truncated") is True


async def test_a_batch_runs_its_slots_in_parallel(driver_backend):
    backend = await driver_backend(slots_per_sandbox=4, max_sandboxes=1)
    slots = [await backend.acquire(f"par-{i}") for i in range(4)]
    cmd = "python3 -c 'import time; s=time.time(); time.sleep(1); print(s, time.time())'"
    results = await backend.execute_batch([(s, "bash", {"command": cmd}) for s in slots])
    spans = [tuple(map(float, r.output.split())) for r in results]
    assert all(r.success for r in results), results
    # Every command was running while every other was: the spans overlap.
    assert max(start for start, _ in spans) < min(end for _, end in spans)
    assert [r.slot_id for r in results] == [s.slot_id for s in slots]


async def test_sandbox_death_mid_batch_fails_its_calls_and_the_pool_recovers(
        driver_backend, driver, request):
    backend = await driver_backend(slots_per_sandbox=2, min_sandboxes=1, max_sandboxes=1,
                                   execution_timeout_s=60)
    a = await backend.acquire("dies-a")
    b = await backend.acquire("dies-b")
    batch = asyncio.ensure_future(backend.execute_batch([
        (a, "bash", {"command": "echo a-start; sleep 30"}),
        (b, "bash", {"command": "echo b-start; sleep 30"}),
    ]))
    await asyncio.sleep(1.0)
    assert not batch.done()
    killed_at = time.monotonic()
    if driver in ("local", "local-hosts"):
        [pid] = agent_processes()
        os.kill(pid, 9)
        reason = "killed by signal 9"
    else:
        server = request.getfixturevalue("modal_server")
        [record] = running_sandboxes(server, backend.default_profile)
        await on_server(server, server.terminate_sandbox(record.sandbox_id, status="oom"))
        reason = "out of memory"
    results = await asyncio.wait_for(batch, 10)
    assert time.monotonic() - killed_at < 5
    for r in results:
        assert not r.success
        assert "died" in r.error and reason in r.error, r.error
    await backend.release(a)
    await backend.release(b)
    status = await eventually(
        lambda: asyncio.sleep(0, backend.get_status()),
        lambda s: s["pools"][backend.default_profile]["healthy_sandboxes"] == 1, timeout=20)
    assert status["pools"][backend.default_profile]["sandboxes_died"] == 1
    fresh = await backend.acquire("after-death")
    r = await bash(backend, fresh, "echo alive")
    assert r.output == "alive\n"


@pytest.fixture
def secret_value(driver, request, monkeypatch):
    """A secret named ``my-api-key`` holding ``API_KEY``: a dotenv file for the local
    driver, a Modal secret on the local control plane for the Modal driver."""
    value = "sk-test-" + secrets.token_hex(12)
    if driver == "modal":
        request.getfixturevalue("modal_server").add_secret("my-api-key", {"API_KEY": value})
        yield value
        return
    path = Path(tempfile.mkdtemp(prefix="hmt-secrets-", dir="/opt" if os.path.isdir("/opt") else None))
    (path / "my-api-key.env").write_text(f"API_KEY={value}\n")
    monkeypatch.setenv("HERMES_MODAL_TOOL_SECRETS_DIR", str(path))
    yield value
    shutil.rmtree(path, ignore_errors=True)


async def test_a_secret_reaches_only_its_profiles_slots(driver_backend, secret_value, caplog):
    backend = await driver_backend(profiles={
        "with-secret": SandboxConfig(**{**SMALL, "name": "with-secret", "secrets": ["my-api-key"]}),
        "plain": SandboxConfig(**{**SMALL, "name": "plain", "min_sandboxes": 0}),
    }, default_profile="with-secret")
    s1 = await backend.acquire("needs-key", profile="with-secret")
    s2 = await backend.acquire("no-key", profile="plain")
    r1, r2 = await backend.execute_batch([
        (s1, "bash", {"command": 'echo "$API_KEY"'}),
        (s2, "bash", {"command": "env"}),
    ])
    assert r1.output == f"{secret_value}\n"
    assert r2.success and secret_value not in r2.output and "API_KEY" not in r2.output
    assert secret_value not in json.dumps(backend.get_status(), default=str)
    assert secret_value not in caplog.text


async def test_a_slot_owns_its_root_or_status_says_workspace_only(driver_backend):
    """With a layered root (``filesystem: overlay``) a slot is root and writes /usr, /etc and
    /workspace privately; where the sandbox cannot give slots one, status says
    ``workspace-only`` and why, and the system directories stay read-only."""
    backend = await driver_backend(slots_per_sandbox=2, max_sandboxes=1)
    pool = backend.get_status()["pools"][backend.default_profile]
    tag = secrets.token_hex(4)
    a = await backend.acquire("owner")
    b = await backend.acquire("neighbour")
    writes = (f"echo {tag} > /usr/local/bin/tool-{tag}; echo {tag} > /etc/motd-{tag}; "
              f"mkdir -p /workspace && echo {tag} > /workspace/x-{tag}")
    ra = await bash(backend, a, f"{writes}; id -u")
    reads = f"cat /usr/local/bin/tool-{tag} /etc/motd-{tag} /workspace/x-{tag} 2>&1"
    if pool["filesystem"] == "overlay":
        assert ra.success and ra.output.split() == ["0"], (ra.output, ra.error)
        rb = await bash(backend, b, reads)
        assert tag not in rb.output.replace(f"-{tag}", "")
        await backend.release(a, reset_workspace=True)
        again = await backend.acquire("next")
        rc = await bash(backend, again, reads)
        assert tag not in rc.output.replace(f"-{tag}", "")
    else:
        assert pool["filesystem"] == "workspace-only" and pool["filesystem_note"], pool
        assert not ra.success and tag not in (await bash(backend, b, reads)).output
    on_host = await asyncio.to_thread(lambda: [os.path.lexists(f"/usr/local/bin/tool-{tag}"),
                                                os.path.lexists(f"/etc/motd-{tag}")])
    assert on_host == [False, False]


async def test_files_move_in_chunks_and_release_says_what_the_lease_used(driver_backend):
    backend = await driver_backend(slots_per_sandbox=2)
    slot = await backend.acquire("ledger")
    data = os.urandom(2_200_000)  # three chunks
    up = await backend.upload(slot, data, "w/blob.bin")
    r = await bash(backend, slot, "sha256sum w/blob.bin")
    assert r.output.split()[0] == up.sha256 == hashlib.sha256(data).hexdigest()
    out = io.BytesIO()
    assert (await backend.download(slot, "w/blob.bin", out)).sha256 == up.sha256
    assert out.getvalue() == data
    used = await backend.release(slot, measure_disk=True)
    assert used.calls["bash"] == 1 and used.calls["upload"] == 1 and used.calls["download"] == 1
    assert used.disk_bytes >= len(data)
    assert used.source in ("cgroup-v1", "cgroup-v2", "agent"), used
    if used.source != "agent":
        assert used.cpu_s > 0 and used.memory_peak_bytes > 0
