"""The two places the Modal driver reaches past the SDK's public API (``modal`` 1.6).

Everything else in :mod:`.modal` uses public ``.aio`` calls. These helpers run on
the SDK's own event loop (through ``synchronize_api``, like the SDK's methods),
because its gRPC channels belong to that loop:

- :func:`pump_output` reads the agent's stdout there and hands chunks over with one
  thread hop (public API, but iterated on the SDK's loop for speed);
- :func:`run_stdin_stream` holds ONE ``TaskExecStdinWriteStream`` open for the
  agent's whole life, so a command is one message on an open stream instead of
  one ``TaskExecStdinWrite`` RPC per write (what ``process.stdin.drain()`` does).
- :func:`sandbox_result` reads why a sandbox ended (the ``GenericResult`` status
  and message), which the public API only exposes as an exit code or a bare
  ``SandboxTerminatedError``.

The SDK is pinned to ``>=1.6,<1.7`` for this reason.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Any

from modal._utils.async_utils import synchronize_api
from modal_proto import api_pb2

STATUS_NAMES = {
    api_pb2.GenericResult.GENERIC_STATUS_UNSPECIFIED: "running",
    api_pb2.GenericResult.GENERIC_STATUS_SUCCESS: "exited",
    api_pb2.GenericResult.GENERIC_STATUS_FAILURE: "failed",
    api_pb2.GenericResult.GENERIC_STATUS_TERMINATED: "terminated",
    api_pb2.GenericResult.GENERIC_STATUS_TIMEOUT: "timeout",
    api_pb2.GenericResult.GENERIC_STATUS_INIT_FAILURE: "init_failure",
    api_pb2.GenericResult.GENERIC_STATUS_INTERNAL_FAILURE: "internal_failure",
    api_pb2.GenericResult.GENERIC_STATUS_IDLE_TIMEOUT: "idle_timeout",
    api_pb2.GenericResult.GENERIC_STATUS_MEMORY_MANAGER_EVICTION: "oom",
    api_pb2.GenericResult.GENERIC_STATUS_MEMORY_THRASHING_EVICTION: "oom",
    api_pb2.GenericResult.GENERIC_STATUS_KERNEL_OOM_KILL: "oom",
}

# Bytes kept after they were sent, to resume the stream after a transient break.
RESUME_WINDOW = 8 * 1024 * 1024


class StdinPipe:
    """Bytes for one exec's stdin, written from any thread, sent in order on one stream.

    ``write()`` never blocks and makes no RPC; ``close()`` ends the stream (the
    process sees EOF). ``sent`` counts the bytes handed to the stream.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._early: list[bytes] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue | None = None
        self._closed = False
        self.sent = 0
        self.history: collections.deque[tuple[int, bytes]] = collections.deque()
        self._history_bytes = 0

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._closed:
                return
            if self._queue is None:
                self._early.append(data)
                return
            loop, queue = self._loop, self._queue
        loop.call_soon_threadsafe(queue.put_nowait, data)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._queue is None:
                self._early.append(None)
                return
            loop, queue = self._loop, self._queue
        try:
            loop.call_soon_threadsafe(queue.put_nowait, None)
        except RuntimeError:  # the SDK's loop is gone (interpreter exit)
            pass

    def _bind(self) -> asyncio.Queue:
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
            for item in self._early:
                self._queue.put_nowait(item)
            self._early = []
        return self._queue

    def _remember(self, data: bytes) -> None:
        self.history.append((self.sent, data))
        self.sent += len(data)
        self._history_bytes += len(data)
        while self._history_bytes > RESUME_WINDOW and len(self.history) > 1:
            _, old = self.history.popleft()
            self._history_bytes -= len(old)

    def _replay_from(self, offset: int) -> list[bytes] | None:
        """The bytes from ``offset`` on, or None when they are no longer kept."""
        out = []
        for start, data in self.history:
            end = start + len(data)
            if end <= offset:
                continue
            if start > offset and not out:
                return None
            out.append(data[max(0, offset - start):])
        if not out and offset != self.sent:
            return None
        return out


async def _run_stdin_stream(process: Any, pipe: StdinPipe, max_resumes: int = 5) -> int:
    """Send ``pipe`` to ``process``'s stdin on one client stream until it is closed.

    On a transient break, asks the router how many bytes arrived and resumes from
    there (bounded). Returns the bytes written. Runs on the SDK's loop.
    """
    router = process._command_router_client
    task_id, exec_id = process._task_id, process._process_id
    queue = pipe._bind()
    start = 0
    replay: list[bytes] = []
    resumes = 0
    while True:
        async def chunks(replay=replay):
            for data in replay:
                yield data
            while True:
                data = await queue.get()
                if data is None:
                    return
                pipe._remember(data)
                yield data

        try:
            await router._exec_stdin_write_stream(task_id, exec_id, start, chunks())
            return pipe.sent
        except asyncio.CancelledError:
            raise
        except Exception:
            resumes += 1
            if resumes > max_resumes:
                raise
            status = await router.exec_stdin_status(task_id=task_id, exec_id=exec_id)
            if status.closed:
                raise
            replay = pipe._replay_from(status.num_bytes_written)
            if replay is None:
                raise
            start = status.num_bytes_written


async def _pump_output(stream: Any, loop: asyncio.AbstractEventLoop, on_chunk: Any) -> None:
    """Read ``stream`` (an exec's stdout) on the SDK's loop and hand each chunk to
    ``on_chunk`` on ``loop``: one thread hop per chunk instead of the two an ``.aio``
    iteration makes. Returns at the end of the stream."""
    async for chunk in stream:
        if chunk:
            loop.call_soon_threadsafe(on_chunk, chunk)


async def _sandbox_result(sandbox: Any) -> tuple[str, str, int | None]:
    """``(status, message, exit_code)`` of a sandbox now; status ``"running"`` if it runs."""
    impl = sandbox._impl
    await impl.poll()
    result = impl.result
    if result is None or not result.status:
        return "running", "", None
    code = result.exitcode if result.status == api_pb2.GenericResult.GENERIC_STATUS_SUCCESS else None
    return STATUS_NAMES.get(result.status, f"status {result.status}"), result.exception, code


run_stdin_stream = synchronize_api(_run_stdin_stream, target_module=__name__)
pump_output = synchronize_api(_pump_output, target_module=__name__)
sandbox_result = synchronize_api(_sandbox_result, target_module=__name__)
