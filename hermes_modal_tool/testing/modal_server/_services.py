"""The two gRPC services (control plane, task command router): each RPC names the
server method that answers it."""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import grpclib.const
import grpclib.server
from modal._utils.grpc_testing import patch_mock_servicer
from modal_proto import api_grpc, task_command_router_grpc


class _Server(Protocol):
    """What the services need of :class:`~.server.LocalModalServer` (named here, so this
    module does not import the server back); handlers reach its methods by name."""

    def _instrument(self, mapping: dict[str, grpclib.const.Handler], *,
                    control_plane: bool) -> dict[str, grpclib.const.Handler]: ...


class _CountingStream:
    """A server stream whose received request messages are counted per method."""

    def __init__(self, stream: grpclib.server.Stream, name: str, counts: collections.Counter) -> None:
        self._stream, self._name, self._counts = stream, name, counts

    async def recv_message(self) -> Any:
        message = await self._stream.recv_message()
        if message is not None:
            self._counts[self._name] += 1
        return message

    def __aiter__(self) -> _CountingStream:
        return self

    async def __anext__(self) -> Any:
        message = await self.recv_message()
        if message is None:
            raise StopAsyncIteration
        return message

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _unary(impl: str) -> Callable[[Any, grpclib.server.Stream], Awaitable[None]]:
    """A unary handler calling ``LocalModalServer.<impl>(request, stream)`` for its reply."""

    async def handler(self: Any, stream: grpclib.server.Stream) -> None:
        request = await stream.recv_message()
        await stream.send_message(await getattr(self.server, impl)(request, stream))

    handler.__name__ = impl
    return handler


def _streaming(impl: str) -> Callable[[Any, grpclib.server.Stream], Awaitable[None]]:
    """A handler delegating the whole stream to ``LocalModalServer.<impl>(stream)``."""

    async def handler(self: Any, stream: grpclib.server.Stream) -> None:
        await getattr(self.server, impl)(stream)

    handler.__name__ = impl
    return handler


@patch_mock_servicer
class _ControlPlane(api_grpc.ModalClientBase):
    """Modal's client API; methods not listed here answer UNIMPLEMENTED."""

    def __init__(self, server: _Server) -> None:
        self.server = server

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return self.server._instrument(super().__mapping__(), control_plane=True)

    ClientHello = _unary("_client_hello")
    AuthTokenGet = _unary("_auth_token_get")
    EnvironmentGetOrCreate = _unary("_environment_get_or_create")
    AppGetOrCreate = _unary("_app_get_or_create")
    AppList = _unary("_app_list")
    ImageGetOrCreate = _unary("_image_get_or_create")
    ImageJoinStreaming = _unary("_image_join_streaming")
    ImageFromId = _unary("_image_from_id")
    MountGetOrCreate = _unary("_mount_get_or_create")
    MountPutFile = _unary("_mount_put_file")
    SecretGetOrCreate = _unary("_secret_get_or_create")
    SandboxCreate = _unary("_sandbox_create")
    SandboxCreateV2 = _unary("_sandbox_create")
    SandboxGetTaskId = _unary("_sandbox_get_task_id")
    SandboxGetTaskIdV2 = _unary("_sandbox_get_task_id")
    SandboxWait = _unary("_sandbox_wait")
    SandboxWaitV2 = _unary("_sandbox_wait")
    SandboxTerminate = _unary("_sandbox_terminate")
    SandboxTerminateV2 = _unary("_sandbox_terminate")
    SandboxList = _unary("_sandbox_list")
    SandboxListV2 = _unary("_sandbox_list")
    SandboxTagsGet = _unary("_sandbox_tags_get")
    SandboxTagsGetV2 = _unary("_sandbox_tags_get")
    SandboxTagsSet = _unary("_sandbox_tags_set")
    SandboxTagsSetV2 = _unary("_sandbox_tags_set")
    SandboxGetFromName = _unary("_sandbox_get_from_name")
    SandboxGetFromNameV2 = _unary("_sandbox_get_from_name")
    TaskGetCommandRouterAccess = _unary("_router_access")
    SandboxGetCommandRouterAccess = _unary("_router_access")
    SandboxStdinWrite = _unary("_sandbox_stdin_write")
    SandboxGetLogs = _streaming("_sandbox_get_logs")
    VolumeGetOrCreate = _unary("_volume_get_or_create")
    VolumeDelete = _unary("_volume_delete")


@patch_mock_servicer
class _CommandRouter(task_command_router_grpc.TaskCommandRouterBase):
    """The task command router of every sandbox (bearer JWT per task)."""

    def __init__(self, server: _Server) -> None:
        self.server = server

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return self.server._instrument(super().__mapping__(), control_plane=False)

    TaskExecStart = _unary("_exec_start")
    TaskExecStdioRead = _streaming("_exec_stdio_read")
    TaskExecStdinWrite = _unary("_exec_stdin_write")
    TaskExecStdinWriteStream = _streaming("_exec_stdin_write_stream")
    TaskExecStdinStatus = _unary("_exec_stdin_status")
    TaskExecWait = _unary("_exec_wait")
    TaskExecPoll = _unary("_exec_poll")
    SandboxStdioReadV2 = _streaming("_sandbox_stdio_read_v2")
    SandboxStdinWriteV2 = _unary("_sandbox_stdin_write_v2")
    SandboxWaitUntilReady = _unary("_sandbox_wait_until_ready")
    TaskSnapshotFilesystem = _unary("_task_snapshot_filesystem")
