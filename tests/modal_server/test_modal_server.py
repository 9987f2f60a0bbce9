"""The local Modal control plane, driven by the real ``modal`` SDK (its ``.aio`` API).

Every sandbox here is a real bubblewrap container on this machine; the server is
reached through ``MODAL_SERVER_URL`` like Modal itself.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import io
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpclib.client
import modal
import modal.exception
import pytest
from grpclib import Status
from modal._utils.async_utils import synchronizer
from modal_proto import api_grpc, api_pb2, task_command_router_grpc
from modal_proto import task_command_router_pb2 as sr_pb2

from hermes_modal_tool.testing.modal_server import LocalModalServer, serve_in_thread

pytestmark = pytest.mark.timeout(60)

ECHO_LOOP = (
    "import sys\n"
    "for line in sys.stdin:\n"
    "    sys.stdout.write('echo:' + line)\n"
    "    sys.stdout.flush()\n"
)
NETWORK_PROBE = (
    "import socket, sys\n"
    "def connect(port):\n"
    "    s = socket.socket()\n"
    "    s.settimeout(2)\n"
    "    try:\n"
    "        s.connect(('127.0.0.1', port))\n"
    "        return 'ok'\n"
    "    except OSError as exc:\n"
    "        return type(exc).__name__\n"
    "    finally:\n"
    "        s.close()\n"
    "inside = socket.socket()\n"
    "inside.bind(('127.0.0.1', 0))\n"
    "inside.listen()\n"
    "print(connect(int(sys.argv[1])), connect(inside.getsockname()[1]))\n"
)
NESTED_BWRAP = (
    "import os, subprocess\n"
    "os.setgroups([]); os.setgid(200000); os.setuid(200000)\n"
    "argv = ['bwrap', '--unshare-user', '--unshare-pid', '--ro-bind', '/', '/',\n"
    "        '--proc', '/proc', '--dev', '/dev', 'sh', '-c', 'id -u; echo $$']\n"
    "r = subprocess.run(argv, capture_output=True, text=True)\n"
    "print(r.returncode, r.stdout.split(), r.stderr.strip())\n"
)


# -- helpers ---------------------------------------------------------------------------


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (e.g. a server's state dir)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
    return found


async def on_sdk_loop(coro: Any) -> Any:
    """Run a coroutine of the SDK's internals on the SDK's own event loop."""
    loop = synchronizer._get_loop(start=True)
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


class StdinFeed:
    """Chunks put here (on the test's loop) are yielded on the SDK's loop, for one
    long-lived ``TaskExecStdinWriteStream``; ``close()`` ends it (EOF)."""

    def __init__(self, queue: asyncio.Queue) -> None:
        self.queue = queue
        self.loop = synchronizer._get_loop(start=True)

    @classmethod
    async def create(cls) -> StdinFeed:
        async def make() -> asyncio.Queue:
            return asyncio.Queue()

        return cls(await on_sdk_loop(make()))

    def put(self, data: bytes) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, data)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    async def chunks(self) -> AsyncIterator[bytes]:
        while (item := await self.queue.get()) is not None:
            yield item


@contextlib.asynccontextmanager
async def raw_channel(server: LocalModalServer) -> AsyncIterator[grpclib.client.Channel]:
    """A plain grpclib channel to the server, to see replies exactly as sent."""
    channel = grpclib.client.Channel("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
    try:
        yield channel
    finally:
        channel.close()


def token_metadata(server: LocalModalServer) -> dict[str, str]:
    return {"x-modal-token-id": server.token_id, "x-modal-token-secret": server.token_secret}


async def raw_sandbox_wait(server: LocalModalServer, sandbox_id: str) -> api_pb2.SandboxWaitResponse:
    async with raw_channel(server) as channel:
        return await api_grpc.ModalClientStub(channel).SandboxWait(
            api_pb2.SandboxWaitRequest(sandbox_id=sandbox_id, timeout=0),
            metadata=token_metadata(server))


async def run(sb: Any, *argv: str, **kwargs: Any) -> tuple[int, str, str]:
    p = await sb.exec.aio(*argv, **kwargs)
    out, err = await asyncio.gather(p.stdout.read.aio(), p.stderr.read.aio())
    return await p.wait.aio(), out, err


# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture
async def server(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[LocalModalServer]:
    """A started server the SDK points at; afterwards nothing of it may remain."""
    monkeypatch.setenv("OPENAI_API_KEY", "host-canary")  # must never reach a sandbox
    async with LocalModalServer() as srv:
        assert srv.isolation == "bwrap", "these tests need bubblewrap containers"
        for key, value in srv.env().items():
            monkeypatch.setenv(key, value)
        LocalModalServer.reset_env_client()
        try:
            yield srv
        finally:
            with contextlib.suppress(Exception):
                await (await modal.Client.from_env.aio()).close.aio()
            LocalModalServer.reset_env_client()
    assert srv.state_dir is not None and not srv.state_dir.exists()
    assert processes_mentioning(str(srv.state_dir)) == []


@pytest.fixture(params=[1, 2], ids=["v1", "v2"])
def api(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Which sandbox API the SDK uses (``MODAL_SANDBOX_V2``)."""
    monkeypatch.setenv("MODAL_SANDBOX_V2", "1" if request.param == 2 else "0")
    return request.param


@pytest.fixture
async def app(server: LocalModalServer) -> Any:
    return await modal.App.lookup.aio("modal-server-tests", create_if_missing=True)


# -- apps, images, secrets, creation -------------------------------------------------------


async def test_app_lookup_creates_once_and_unknown_apps_are_not_found(
        server: LocalModalServer) -> None:
    first = await modal.App.lookup.aio("tools", create_if_missing=True)
    again = await modal.App.lookup.aio("tools")
    assert first.app_id == again.app_id and first.app_id.startswith("ap-")
    with pytest.raises(modal.exception.NotFoundError, match="App 'missing' not found"):
        await modal.App.lookup.aio("missing")


async def test_registry_image_with_add_python_is_recorded(server: LocalModalServer, app: Any) -> None:
    image = modal.Image.from_registry("ubuntu:22.04", add_python="3.11")
    sb = await modal.Sandbox.create.aio(app=app, image=image)
    record = server.sandboxes[sb.object_id]
    assert record.image_tag == "ubuntu:22.04"
    assert record.image_python is not None and record.image_python.startswith("3.11.")
    assert record.image_commands[0] == "FROM ubuntu:22.04"
    assert "COPY /python/. /usr/local" in record.image_commands
    slim = await modal.Sandbox.create.aio(app=app, image=modal.Image.debian_slim())
    assert server.sandboxes[slim.object_id].image_tag.startswith("python:3.")
    assert (server.sandboxes[slim.object_id].image_python or "").startswith("3.")
    assert server.images[record.image_id].python_version == record.image_python


async def test_create_records_resources_secrets_network_and_tags(
        server: LocalModalServer, app: Any) -> None:
    server.add_secret("team-secret", {"TEAM_TOKEN": "t0k3n"})
    sb = await modal.Sandbox.create.aio(
        app=app, image=modal.Image.debian_slim(), cpu=1.5, memory=(512, 1024), gpu="T4",
        timeout=120, idle_timeout=60, secrets=[modal.Secret.from_name("team-secret")],
        env={"PLAIN": "1"}, block_network=True, tags={"pool": "p1"}, workdir="/workspace/app")
    record = server.sandboxes[sb.object_id]
    assert record.api_version == 1  # GPU sandboxes always use the V1 API
    assert (record.cpu, record.memory_mib, record.memory_limit_mib, record.gpu) == (1.5, 512, 1024, "T4")
    assert (record.timeout_s, record.idle_timeout_s, record.block_network) == (120, 60, True)
    assert record.secret_names == ["team-secret"] and record.env == {"PLAIN": "1"}
    assert record.tags == {"pool": "p1"} and record.app_name == "modal-server-tests"
    assert record.status == "running" and record.task_id and record.live_execs == 0
    code, out, _ = await run(sb, "bash", "-c", 'echo "$TEAM_TOKEN $PLAIN $(pwd)"')
    assert (code, out) == (0, "t0k3n 1 /workspace/app\n")


async def test_unknown_named_secret_raises_not_found(server: LocalModalServer, app: Any) -> None:
    with pytest.raises(modal.exception.NotFoundError,
                       match="Secret 'nope' not found in environment 'main'"):
        await modal.Sandbox.create.aio(app=app, secrets=[modal.Secret.from_name("nope")])
    assert server.sandboxes == {}


async def test_rpc_cost_of_create_and_one_exec(server: LocalModalServer, app: Any, api: int) -> None:
    image = modal.Image.debian_slim()
    await modal.Sandbox.create.aio(app=app, image=image)  # builds the image, fetches tokens
    server.reset_counts()
    sb = await modal.Sandbox.create.aio(app=app, image=image)
    created = dict(server.rpc_counts)
    assert await run(sb, "true") == (0, "", "")
    execs = server.rpc_counts - collections.Counter(created)
    if api == 1:
        assert created == {"SandboxCreate": 1, "SandboxGetTaskId": 1}
        assert dict(execs) == {"TaskGetCommandRouterAccess": 1, "TaskExecStart": 1,
                               "TaskExecStdioRead": 2, "TaskExecWait": 1}
    else:  # V2: the task id and router access come with SandboxCreateV2
        assert created == {"SandboxCreateV2": 1}
        assert dict(execs) == {"TaskExecStart": 1, "TaskExecStdioRead": 2, "TaskExecWait": 1}


async def test_failed_creates_raise_resource_exhausted_then_recover(
        server: LocalModalServer, app: Any) -> None:
    server.fail_next_creates(1, message="sandbox rate limit (test)")
    with pytest.raises(modal.exception.ResourceExhaustedError, match="rate limit"):
        await modal.Sandbox.create.aio(app=app)
    sb = await modal.Sandbox.create.aio(app=app)
    assert server.sandboxes[sb.object_id].status == "running"
    server.fail_next_creates(1, status=Status.UNAVAILABLE)  # retried by the SDK
    assert await modal.Sandbox.create.aio(app=app)


async def test_failed_image_builds_raise_image_build_error(server: LocalModalServer, app: Any) -> None:
    server.fail_image_builds("broken", message="no such manifest (test)")
    with pytest.raises(modal.exception.ImageBuildError, match="no such manifest") as failure:
        await modal.Sandbox.create.aio(app=app, image=modal.Image.from_registry("org/broken:1"))
    assert isinstance(failure.value, modal.exception.RemoteError)
    sb = await modal.Sandbox.create.aio(app=app, image=modal.Image.from_registry("org/fine:1"))
    assert server.sandboxes[sb.object_id].image_tag == "org/fine:1"


async def test_bad_token_raises_auth_error(server: LocalModalServer,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "wrong")
    LocalModalServer.reset_env_client()
    with pytest.raises(modal.exception.AuthError, match="Invalid token"):
        await modal.App.lookup.aio("tools", create_if_missing=True)
    assert server.rpc_counts["AppGetOrCreate"] == 1


async def test_command_router_checks_its_jwt_and_unknown_rpcs_are_unimplemented(
        server: LocalModalServer, app: Any) -> None:
    one = await modal.Sandbox.create.aio(app=app, gpu="T4")  # V1: router access by task id
    two = await modal.Sandbox.create.aio(app=app, gpu="T4")
    task_one, task_two = (server.sandboxes[sb.object_id].task_id for sb in (one, two))
    async with raw_channel(server) as channel:
        control = api_grpc.ModalClientStub(channel)
        access = await control.TaskGetCommandRouterAccess(
            api_pb2.TaskGetCommandRouterAccessRequest(task_id=task_one),
            metadata=token_metadata(server))
        assert access.url == server.url
        payload = access.jwt.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        assert claims["task_id"] == task_one and claims["exp"] > time.time() + 86400 * 365
        router = task_command_router_grpc.TaskCommandRouterStub(channel)
        poll = sr_pb2.TaskExecPollRequest(task_id=task_one, exec_id="nope")
        with pytest.raises(grpclib.GRPCError) as wrong:
            await router.TaskExecPoll(poll, metadata={"authorization": "Bearer x.y.z"})
        assert wrong.value.status == Status.UNAUTHENTICATED
        other_task = sr_pb2.TaskExecPollRequest(task_id=task_two, exec_id="nope")
        with pytest.raises(grpclib.GRPCError) as other:
            await router.TaskExecPoll(other_task, metadata={"authorization": f"Bearer {access.jwt}"})
        assert other.value.status == Status.UNAUTHENTICATED
        with pytest.raises(grpclib.GRPCError) as missing:
            await router.TaskExecPoll(poll, metadata={"authorization": f"Bearer {access.jwt}"})
        assert missing.value.status == Status.NOT_FOUND
        with pytest.raises(grpclib.GRPCError) as unknown:
            await control.VolumeGetOrCreate(api_pb2.VolumeGetOrCreateRequest(deployment_name="v"),
                                            metadata=token_metadata(server))
        assert unknown.value.status == Status.UNIMPLEMENTED
        assert "VolumeGetOrCreate not implemented" in (unknown.value.message or "")


# -- execs ---------------------------------------------------------------------------------


async def test_exec_output_exit_code_env_and_filesystem(
        server: LocalModalServer, app: Any, api: int) -> None:
    sb = await modal.Sandbox.create.aio(app=app, env={"SANDBOX_VAR": "s"})
    script = ('echo out; echo err >&2; echo "$SANDBOX_VAR $EXEC_VAR $FROM_DICT $HOME";'
              'env | grep -c host-canary; touch /not-writable 2>/dev/null || echo ro; exit 3')
    code, out, err = await run(sb, "bash", "-c", script, env={"EXEC_VAR": "e"},
                               secrets=[modal.Secret.from_dict({"FROM_DICT": "d"})])
    assert (code, err) == (3, "err\n")
    assert out == "out\ns e d /root\n0\nro\n"
    # Writable directories are the sandbox's own and shared by its execs.
    assert (await run(sb, "bash", "-c", "echo hi > /workspace/f; echo x > /tmp/g"))[0] == 0
    assert (await run(sb, "cat", "/workspace/f", "/tmp/g"))[1] == "hi\nx\n"
    assert (server.sandboxes[sb.object_id].state_dir / "fs" / "workspace" / "f").read_text() == "hi\n"
    assert server.sandboxes[sb.object_id].exec_count == 3


async def test_long_lived_exec_over_one_stdin_stream_costs_no_rpc_per_message(
        server: LocalModalServer, app: Any) -> None:
    sb = await modal.Sandbox.create.aio(app=app)
    process = await sb.exec.aio("python3", "-u", "-c", ECHO_LOOP)
    task_id = await sb._get_task_id.aio()
    router = await sb._get_command_router_client.aio(task_id)
    exec_id = synchronizer._translate_in(process)._process_id
    feed = await StdinFeed.create()
    writer = asyncio.ensure_future(on_sdk_loop(
        router._exec_stdin_write_stream(task_id, exec_id, 0, feed.chunks())))
    lines = process.stdout.__aiter__()
    feed.put(b"warm up\n")
    assert await lines.__anext__() == "echo:warm up\n"
    rpcs, messages = dict(server.rpc_counts), server.stream_messages["TaskExecStdinWriteStream"]
    assert rpcs["TaskExecStdinWriteStream"] == 1 and rpcs["TaskExecStdioRead"] == 1
    for i in range(20):
        feed.put(f"line {i}\n".encode())
        assert await lines.__anext__() == f"echo:line {i}\n"
    assert dict(server.rpc_counts) == rpcs  # 20 round trips, not one RPC more
    assert server.stream_messages["TaskExecStdinWriteStream"] == messages + 20
    await asyncio.sleep(1.5)  # the stream stays open while idle
    feed.put(b"still there\n")
    assert await lines.__anext__() == "echo:still there\n"
    feed.close()  # End: stdin EOF, the loop exits
    await asyncio.wait_for(writer, 10)
    assert await process.wait.aio() == 0
    assert server.sandboxes[sb.object_id].live_execs == 0


async def test_stdin_write_and_drain(server: LocalModalServer, app: Any) -> None:
    sb = await modal.Sandbox.create.aio(app=app)
    process = await sb.exec.aio("python3", "-u", "-c", ECHO_LOOP)
    lines = process.stdout.__aiter__()
    process.stdin.write("one\n")
    await process.stdin.drain.aio()
    assert await lines.__anext__() == "echo:one\n"
    process.stdin.write(b"two\n")
    process.stdin.write_eof()
    await process.stdin.drain.aio()
    assert await lines.__anext__() == "echo:two\n"
    assert await process.wait.aio() == 0
    assert server.rpc_counts["TaskExecStdinWrite"] == 2

    process = await sb.exec.aio("python3", "-u", "-c", ECHO_LOOP)
    assert await process.poll.aio() is None
    assert await process._stdin_write_stream.aio(io.BytesIO(b"a\nb\n")) == 4  # then EOF
    assert await process.stdout.read.aio() == "echo:a\necho:b\n"
    assert await process.wait.aio() == 0 and await process.poll.aio() == 0
    task_id = await sb._get_task_id.aio()
    router = await sb._get_command_router_client.aio(task_id)
    exec_id = synchronizer._translate_in(process)._process_id
    status = await on_sdk_loop(router.exec_stdin_status(task_id, exec_id))
    assert (status.num_bytes_written, status.closed) == (4, True)


async def test_entrypoint_sandbox_runs_its_command_and_finishes(
        server: LocalModalServer, app: Any, api: int) -> None:
    sb = await modal.Sandbox.create.aio("bash", "-c", "read x; echo got $x; echo oops >&2; exit 3",
                                        app=app)
    sb.stdin.write("it\n")
    sb.stdin.write_eof()
    await sb.stdin.drain.aio()
    assert await sb.stdout.read.aio() == "got it\n"
    assert await sb.stderr.read.aio() == "oops\n"
    await sb.wait.aio()
    assert sb.returncode == 3
    record = server.sandboxes[sb.object_id]
    assert (record.status, record.result_reason, record.exit_code) == ("finished", "failure", 3)


# -- isolation -----------------------------------------------------------------------------


async def test_blocked_network_has_only_loopback(server: LocalModalServer, app: Any) -> None:
    port = server.url.rsplit(":", 1)[1]
    blocked = await modal.Sandbox.create.aio(app=app, block_network=True)
    open_ = await modal.Sandbox.create.aio(app=app)
    results = await asyncio.gather(run(blocked, "python3", "-c", NETWORK_PROBE, port),
                                   run(open_, "python3", "-c", NETWORK_PROBE, port))
    assert results[0][:2] == (0, "ConnectionRefusedError ok\n"), results
    assert results[1][:2] == (0, "ok ok\n"), results


async def test_nested_bwrap_works_as_an_unprivileged_uid(server: LocalModalServer, app: Any) -> None:
    sb = await modal.Sandbox.create.aio(app=app)
    code, out, _ = await run(sb, "bash", "-c", "command -v bwrap; ls -ld /run/modal-local")
    assert code == 0 and out.startswith("/run/modal-local/bin/bwrap\n")
    code, out, err = await run(sb, "python3", "-c", NESTED_BWRAP)
    assert (code, out) == (0, "0 ['200000', '2'] \n"), err  # pid 2 in its own PID namespace


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
