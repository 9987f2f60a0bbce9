"""The local Modal control plane, driven by the real ``modal`` SDK: creating things.

Apps, images, secrets and sandbox creation (what the server records, what each
costs in RPCs, injected create and image-build failures), and authentication of
the control plane and the command router. Fixtures and helpers: ``conftest.py``.
"""

from __future__ import annotations

import base64
import collections
import json
import time
from typing import Any

import grpclib
import modal
import modal.exception
import pytest
from grpclib import Status
from modal_proto import api_grpc, api_pb2, task_command_router_grpc
from modal_proto import task_command_router_pb2 as sr_pb2

from hermes_modal_tool.testing.modal_server import LocalModalServer

from .conftest import raw_channel, run, token_metadata

pytestmark = pytest.mark.timeout(60)


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
            # (Volumes are implemented now: tests/test_modal_volumes.py; queues are not.)
            await control.QueueGetOrCreate(api_pb2.QueueGetOrCreateRequest(deployment_name="q"),
                                           metadata=token_metadata(server))
        assert unknown.value.status == Status.UNIMPLEMENTED
        assert "QueueGetOrCreate not implemented" in (unknown.value.message or "")
