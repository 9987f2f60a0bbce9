"""The local Modal control plane, driven by the real ``modal`` SDK: lifetimes.

How sandboxes end (terminated by the client or the server, timeouts), listing them
by tags and name, and running the server itself (from sync code on a thread;
``stop()`` leaves nothing behind). Fixtures and helpers: ``conftest.py``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import modal
import modal.exception
import pytest
from modal_proto import api_pb2

from hermes_modal_tool.testing.modal_server import LocalModalServer, serve_in_thread

from .conftest import processes_mentioning, raw_sandbox_wait

pytestmark = pytest.mark.timeout(60)


# -- lifetime --------------------------------------------------------------------------------


async def test_client_terminate(server: LocalModalServer, app: Any) -> None:
    sb = await modal.Sandbox.create.aio(app=app)
    process = await sb.exec.aio("sleep", "30")
    await sb.terminate.aio()
    assert await asyncio.wait_for(process.wait.aio(), 5) == 137
    with pytest.raises(modal.exception.SandboxTerminatedError):
        await sb.wait.aio()
    assert sb.returncode == 137
    record = server.sandboxes[sb.object_id]
    assert (record.status, record.result_reason, record.live_execs) == ("finished", "terminated", 0)
    with pytest.raises(modal.exception.NotFoundError):  # no more execs
        await sb.exec.aio("true")


async def test_server_side_death_mid_exec(server: LocalModalServer, app: Any) -> None:
    sb = await modal.Sandbox.create.aio(app=app)
    process = await sb.exec.aio("bash", "-c", "echo started; sleep 30; echo never")
    lines = process.stdout.__aiter__()
    assert await lines.__anext__() == "started\n"
    rest = asyncio.ensure_future(process.stdout.read.aio())
    started = time.monotonic()
    await server.terminate_sandbox(sb.object_id, status="oom", message="out of memory (test)")
    assert await asyncio.wait_for(rest, 5) == ""  # the stream ends
    assert await asyncio.wait_for(process.wait.aio(), 5) == 137
    assert time.monotonic() - started < 5
    reply = await raw_sandbox_wait(server, sb.object_id)
    assert reply.result.status == api_pb2.GenericResult.GENERIC_STATUS_KERNEL_OOM_KILL
    assert reply.result.exception == "out of memory (test)"
    assert await sb.poll.aio() == 137
    await server.terminate_sandbox(sb.object_id, status="preempted")  # already over: no change
    assert server.sandboxes[sb.object_id].result_reason == "oom"


async def test_timeout_and_idle_timeout(server: LocalModalServer, app: Any) -> None:
    short = await modal.Sandbox.create.aio(app=app, timeout=2)
    idle = await modal.Sandbox.create.aio(app=app, timeout=60, idle_timeout=1)
    busy = await modal.Sandbox.create.aio(app=app, timeout=60, idle_timeout=1)
    sleeper = await busy.exec.aio("sleep", "3")  # a running exec keeps its sandbox busy
    with pytest.raises(modal.exception.SandboxTimeoutError):
        await short.wait.aio()
    assert short.returncode == 124
    await idle.wait.aio(raise_on_termination=False)
    await busy.wait.aio(raise_on_termination=False)
    assert await sleeper.wait.aio() == 0  # it finished before the idle limit struck

    def lifetime(sb: Any) -> float:
        record = server.sandboxes[sb.object_id]
        assert record.finished_at is not None and record.started_at is not None
        return record.finished_at - record.started_at

    reasons = [server.sandboxes[sb.object_id].result_reason for sb in (short, idle, busy)]
    assert reasons == ["timeout", "idle_timeout", "idle_timeout"]
    assert 1.95 <= lifetime(short) < 10
    assert 0.95 <= lifetime(idle) < lifetime(busy)
    assert lifetime(busy) >= 3.95  # the 3 s exec, then 1 s idle
    reply = await raw_sandbox_wait(server, short.object_id)
    assert reply.result.status == api_pb2.GenericResult.GENERIC_STATUS_TIMEOUT


# -- listing and tags --------------------------------------------------------------------------


async def test_list_by_tags_and_set_tags(server: LocalModalServer, app: Any) -> None:
    a1 = await modal.Sandbox.create.aio(app=app, tags={"pool": "a"}, name="first")
    a2 = await modal.Sandbox.create.aio(app=app, tags={"pool": "a", "x": "1"})
    b = await modal.Sandbox.create.aio(app=app, tags={"pool": "b"})

    async def listed(**tags: str) -> set[str]:
        return {sb.object_id async for sb in modal.Sandbox.list.aio(app_id=app.app_id, tags=tags)}

    assert await listed(pool="a") == {a1.object_id, a2.object_id}
    assert await listed() == {a1.object_id, a2.object_id, b.object_id}
    await b.set_tags.aio({"pool": "a", "moved": "yes"})
    assert await b.get_tags.aio() == {"pool": "a", "moved": "yes"}
    assert await listed(pool="a") == {a1.object_id, a2.object_id, b.object_id}
    found = await modal.Sandbox.from_name.aio("modal-server-tests", "first")
    assert found.object_id == a1.object_id
    with pytest.raises(modal.exception.AlreadyExistsError):
        await modal.Sandbox.create.aio(app=app, name="first")
    await a1.terminate.aio()
    assert await listed(pool="a") == {a2.object_id, b.object_id}
    with pytest.raises(modal.exception.NotFoundError):
        await modal.Sandbox.from_name.aio("modal-server-tests", "first")


# -- running it --------------------------------------------------------------------------------


def test_serve_in_thread_from_sync_code(monkeypatch: pytest.MonkeyPatch) -> None:
    with serve_in_thread() as server:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        LocalModalServer.reset_env_client()
        app = modal.App.lookup("sync", create_if_missing=True)
        sb = modal.Sandbox.create(app=app)
        process = sb.exec("bash", "-c", "echo hello from $MODAL_SANDBOX_ID")
        assert process.stdout.read() == f"hello from {sb.object_id}\n"
        assert process.wait() == 0
        sb.terminate()
        state_dir = server.state_dir
        modal.Client.from_env().close()
    LocalModalServer.reset_env_client()
    assert state_dir is not None and not state_dir.exists()
    assert processes_mentioning(str(state_dir)) == []


async def test_stop_kills_everything_and_removes_its_state() -> None:
    server = await LocalModalServer().start()
    client = await server.client()
    try:
        app = await modal.App.lookup.aio("stop", create_if_missing=True, client=client)
        sb = await modal.Sandbox.create.aio("sleep", "60", app=app, client=client)
        process = await sb.exec.aio("bash", "-c", "sleep 60 & sleep 60")
        assert len(processes_mentioning(str(server.state_dir))) >= 2
        assert server.sandboxes[sb.object_id].live_execs == 1
    finally:
        await client.close.aio()
        await server.stop()
    await server.stop()  # twice is fine
    assert server.state_dir is not None and not server.state_dir.exists()
    assert processes_mentioning(str(server.state_dir)) == []
    assert server.sandboxes[sb.object_id].result_reason == "terminated"
    assert process is not None
