"""The task command router: execs, their stdio and stdin, V2 sandbox stdio."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from grpclib import GRPCError, Status
from modal_proto import task_command_router_pb2 as sr_pb2

from ._processes import _Log, _Process, _Sandbox


class _RouterHandlers:
    """The task command router: execs, their stdio and stdin, V2 sandbox stdio.

    A part of :class:`LocalModalServer` (a mixin): it uses the server's state.
    """

    async def _exec_start(self, req: sr_pb2.TaskExecStartRequest, stream: Any) -> sr_pb2.TaskExecStartResponse:
        sb = self._router_sandbox(req.task_id, stream)
        if sb.result is not None:
            raise GRPCError(Status.NOT_FOUND, f"Task {req.task_id} has already finished")
        if req.exec_id in sb.execs:  # idempotent retry
            return sr_pb2.TaskExecStartResponse()
        if not req.command_args:
            raise GRPCError(Status.INVALID_ARGUMENT, "command_args must not be empty")
        if req.workdir and not req.workdir.startswith("/"):
            raise GRPCError(Status.INVALID_ARGUMENT, "workdir must be absolute")
        env, _names, _inline = self._resolve_secrets(req.secret_ids, req.secret_sources)
        env.update(req.env)
        proc = _Process(
            sb, list(req.command_args),
            pipe_stdout=req.stdout_config == sr_pb2.TASK_EXEC_STDOUT_CONFIG_PIPE,
            pipe_stderr=req.stderr_config == sr_pb2.TASK_EXEC_STDERR_CONFIG_PIPE)
        sb.execs[req.exec_id] = proc
        sb.record.live_execs += 1
        sb.record.exec_count += 1
        sb.touch()
        sb._lifetime_changed.set()
        try:
            await self._start_process(sb, proc, {**self._base_env(sb), **env}, req.workdir or None,
                                      req.timeout_secs or None)
        except OSError as exc:
            del sb.execs[req.exec_id]
            sb.record.live_execs -= 1
            raise GRPCError(Status.INTERNAL, f"could not start the exec: {exc}") from exc
        return sr_pb2.TaskExecStartResponse()

    async def _exec_stdio_read(self, stream: Any) -> None:
        req = await stream.recv_message()
        proc = self._exec(req, stream)
        stdout = req.file_descriptor == sr_pb2.TASK_EXEC_STDIO_FILE_DESCRIPTOR_STDOUT
        await self._stream_log(stream, proc.sandbox, proc.stdout if stdout else proc.stderr, req.offset,
                               sr_pb2.TaskExecStdioReadResponse)

    @staticmethod
    async def _stream_log(stream: Any, sb: _Sandbox, log: _Log, offset: int, reply: Any,
                          with_offset: bool = False) -> None:
        while (chunk := await log.read(offset)) is not None:
            msg = reply(data=chunk, starting_offset=offset) if with_offset else reply(data=chunk)
            await stream.send_message(msg)
            offset += len(chunk)
            sb.touch()

    async def _exec_stdin_write(self, req: Any, stream: Any) -> sr_pb2.TaskExecStdinWriteResponse:
        proc = self._exec(req, stream)
        await proc.write_stdin(req.offset, req.data, req.eof)
        return sr_pb2.TaskExecStdinWriteResponse()

    async def _exec_stdin_write_stream(self, stream: Any) -> None:
        first = await stream.recv_message()
        if first is None or first.WhichOneof("payload") != "start":
            raise GRPCError(Status.INVALID_ARGUMENT, "the first message must be a Start")
        proc = self._exec(first.start, stream)
        proc.evict_stdin_stream()
        task = asyncio.current_task()
        assert task is not None
        proc.stdin_stream = task
        offset = first.start.offset
        try:
            async for msg in stream:
                kind = msg.WhichOneof("payload")
                if kind == "data":
                    await proc.write_stdin(offset, msg.data)
                    offset += len(msg.data)
                elif kind == "end":
                    await proc.write_stdin(offset, b"", eof=True)
                    break
                else:
                    raise GRPCError(Status.INVALID_ARGUMENT, "Start may only be the first message")
            await stream.send_message(sr_pb2.TaskExecStdinWriteStreamResponse())
        finally:
            if proc.stdin_stream is task:
                proc.stdin_stream = None

    async def _exec_stdin_status(self, req: Any, stream: Any) -> sr_pb2.TaskExecStdinStatusResponse:
        proc = self._exec(req, stream)
        proc.evict_stdin_stream()
        return sr_pb2.TaskExecStdinStatusResponse(num_bytes_written=proc.stdin_written,
                                                  closed=proc.stdin_closed)

    @staticmethod
    def _exit_reply(proc: _Process, reply: Any) -> Any:
        if proc.exit is None:
            return reply()
        return reply(code=proc.exit[1]) if proc.exit[0] == "code" else reply(signal=proc.exit[1])

    async def _exec_wait(self, req: Any, stream: Any) -> sr_pb2.TaskExecWaitResponse:
        proc = self._exec(req, stream)
        await proc.done.wait()  # grpclib cancels this at the request's deadline
        return self._exit_reply(proc, sr_pb2.TaskExecWaitResponse)

    async def _exec_poll(self, req: Any, stream: Any) -> sr_pb2.TaskExecPollResponse:
        return self._exit_reply(self._exec(req, stream), sr_pb2.TaskExecPollResponse)

    async def _sandbox_stdio_read_v2(self, stream: Any) -> None:
        req = await stream.recv_message()
        sb = self._router_sandbox(req.task_id, stream)
        stdout = req.file_descriptor == sr_pb2.SANDBOX_STDIO_FILE_DESCRIPTOR_STDOUT
        await self._stream_log(stream, sb, sb.stdout if stdout else sb.stderr, req.offset,
                               sr_pb2.SandboxStdioReadV2Response, with_offset=True)

    async def _sandbox_stdin_write_v2(self, req: Any, stream: Any) -> sr_pb2.SandboxStdinWriteV2Response:
        sb = self._router_sandbox(req.task_id, stream)
        if sb.entrypoint is not None:
            await sb.entrypoint.write_stdin(req.offset, req.data, req.eof)
        return sr_pb2.SandboxStdinWriteV2Response()

    async def _sandbox_wait_until_ready(self, req: Any, stream: Any) -> Any:
        sb = self._router_sandbox(req.task_id, stream)
        return sr_pb2.SandboxWaitUntilReadyTcrResponse(ready_at=sb.record.started_at or time.time())
