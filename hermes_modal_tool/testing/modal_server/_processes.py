"""Live state: one output log, one process in a container, one sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, Protocol

from grpclib import GRPCError, Status
from modal_proto import api_pb2

from ._common import _BATCH, _set_pdeathsig
from ._records import SandboxRecord


class _Server(Protocol):
    """What sandboxes and their processes need of :class:`~.server.LocalModalServer` (named
    here, so this module does not import the server back)."""

    isolation: str

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]: ...

    async def _finish(self, sb: _Sandbox, reason: str, message: str, exit_code: int = 137) -> None: ...


class _Log:
    """Append-only bytes of one output stream, readable from any offset while it grows."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False
        self._grew = asyncio.Event()

    def append(self, chunk: bytes) -> None:
        self.data += chunk
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self._grew.set()
        self._grew = asyncio.Event()

    async def read(self, offset: int, limit: int = _BATCH) -> bytes | None:
        """Bytes from ``offset`` on (waiting for some), or None at the end of the stream."""
        while True:
            if offset < len(self.data):
                return bytes(self.data[offset : offset + limit])
            if self.closed:
                return None
            await self._grew.wait()


class _Process:
    """One command in a sandbox's container: its stdio logs, offset-idempotent stdin, exit."""

    def __init__(self, sandbox: _Sandbox, argv: list[str], *, pipe_stdout: bool = True,
                 pipe_stderr: bool = True) -> None:
        self.sandbox = sandbox
        self.argv = argv
        self.stdout, self.stderr = _Log(), _Log()
        self.pipe_stdout, self.pipe_stderr = pipe_stdout, pipe_stderr
        self.stdin_written = 0
        self.stdin_closed = False
        self.stdin_stream: asyncio.Task[Any] | None = None  # the open TaskExecStdinWriteStream
        self.exit: tuple[str, int] | None = None  # ("code", n) or ("signal", n)
        self.done = asyncio.Event()
        self._proc: asyncio.subprocess.Process | None = None
        self._stdin_lock = asyncio.Lock()

    async def start(self, server: _Server, argv: list[str], env: dict[str, str],
                    cwd: str | None, timeout_s: float | None) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE if self.pipe_stdout else asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE if self.pipe_stderr else asyncio.subprocess.DEVNULL,
            env=env, cwd=cwd, start_new_session=True, preexec_fn=_set_pdeathsig)
        server._spawn(self._monitor(timeout_s))

    async def _monitor(self, timeout_s: float | None) -> None:
        proc = self._proc
        assert proc is not None
        pumps = [asyncio.ensure_future(self._pump(reader, log)) for reader, log in
                 ((proc.stdout, self.stdout), (proc.stderr, self.stderr)) if reader is not None]
        try:
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except asyncio.TimeoutError:
                self.kill()
                await proc.wait()
            if self.sandbox.server.isolation == "none":  # no PID namespace: kill what is left
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if pumps:
                await asyncio.wait(pumps, timeout=5)
        finally:
            for task in pumps:
                task.cancel()
            code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
            self.exit = ("signal", -code) if code < 0 else ("code", code)
            self.stdout.close()
            self.stderr.close()
            self.done.set()
            self.sandbox.process_exited(self)

    async def _pump(self, reader: asyncio.StreamReader, log: _Log) -> None:
        while chunk := await reader.read(65536):
            log.append(chunk)
            self.sandbox.touch()

    def kill(self) -> None:
        """SIGKILL the process group (the outer bwrap: its PID namespace dies with it)."""
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)

    async def write_stdin(self, offset: int, data: bytes, eof: bool = False) -> None:
        """Write the part of ``data`` (starting at stdin byte ``offset``) not written yet.

        Raises:
            GRPCError: OUT_OF_RANGE if ``offset`` skips bytes never received;
                FAILED_PRECONDITION for new bytes after stdin was closed.
        """
        async with self._stdin_lock:
            if offset > self.stdin_written:
                raise GRPCError(Status.OUT_OF_RANGE,
                                f"stdin offset {offset} is past the {self.stdin_written} bytes received")
            new = data[self.stdin_written - offset :]
            if new and self.stdin_closed:
                raise GRPCError(Status.FAILED_PRECONDITION, "stdin is already closed")
            if new:
                self.stdin_written += len(new)
                self.sandbox.touch()
                if self._proc is not None and self._proc.stdin is not None and self.exit is None:
                    try:
                        self._proc.stdin.write(new)
                        await self._proc.stdin.drain()
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the process is gone: its output ends, like on Modal
            if eof and not self.stdin_closed:
                self.stdin_closed = True
                if self._proc is not None and self._proc.stdin is not None:
                    self._proc.stdin.close()

    def evict_stdin_stream(self) -> None:
        """End the open stdin stream, if any (a new one or a status query replaces it)."""
        if self.stdin_stream is not None:
            self.stdin_stream.cancel()
            self.stdin_stream = None


class _Sandbox:
    """The live state behind one :class:`SandboxRecord`."""

    def __init__(self, server: _Server, record: SandboxRecord, env: dict[str, str]) -> None:
        self.server = server
        self.record = record
        self.env = env
        self.execs: dict[str, _Process] = {}
        self.entrypoint: _Process | None = None
        self.stdout, self.stderr = _Log(), _Log()  # the entrypoint's (empty without one)
        self.stdin_index = 0  # V1 SandboxStdinWrite message index
        self.result: api_pb2.GenericResult | None = None
        self.finished = asyncio.Event()
        self.started = asyncio.Event()
        self.last_activity = time.monotonic()
        self.deadline = float("inf")
        self._lifetime_changed = asyncio.Event()
        self.net: Any = None  # an allow-listed sandbox's SandboxNet (_network.py)

    @property
    def fs(self) -> Path:
        return self.record.state_dir / "fs"

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def process_exited(self, proc: _Process) -> None:
        self.touch()
        if proc is not self.entrypoint:
            self.record.live_execs -= 1
        elif self.result is None and proc.exit is not None:
            kind, code = proc.exit
            code = code if kind == "code" else 128 + code
            reason = "success" if code == 0 else "failure"
            message = f"Sandbox entrypoint exited with code {code}" if code else ""
            self.server._spawn(self.server._finish(self, reason, message, code))
        self._lifetime_changed.set()

    def metadata(self) -> api_pb2.SandboxHandleMetadata:
        meta = api_pb2.SandboxHandleMetadata(app_id=self.record.app_id)
        if self.result is not None:
            meta.result.CopyFrom(self.result)
        return meta
