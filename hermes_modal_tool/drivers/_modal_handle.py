"""A running Modal sandbox as the pool sees it: the agent's exec stdio as a byte channel,
the owner's heartbeat on it, and why the sandbox ended when it does (see
:mod:`hermes_modal_tool.drivers.modal`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

from .. import protocol
from ..config import SandboxConfig
from . import _modal_sdk
from .base import SandboxHandle

log = logging.getLogger("hermes_modal_tool")


class _Driver(Protocol):
    """What a handle needs of its :class:`~.modal.ModalDriver` (named here, so this module
    does not import the driver back): the sandboxes it started and has not yet ended, by
    Modal object id (read at each use: the driver swaps the dict when it closes)."""

    _live: dict[str, Any]

_DEATH_TEXT = {
    "timeout": "Modal ended the sandbox at its timeout (max_lifetime {max_lifetime:g} s)",
    "idle_timeout": "Modal ended the sandbox after its idle_timeout ({idle_timeout:g} s)",
    "oom": "the sandbox ran out of memory (memory {memory} MiB); raise memory or lower "
           "slots_per_sandbox",
    "terminated": "the sandbox was terminated (sandbox.terminate(), the Modal dashboard or "
                  "'modal sandbox terminate')",
    "internal_failure": "Modal lost the sandbox (internal failure or preemption)",
    "init_failure": "the sandbox failed to start",
    "failed": "the sandbox failed",
    "exited": "the sandbox's watchdog ended it: the agent heard nothing from this process for "
              "heartbeat_timeout ({heartbeat_timeout:g} s; was the event loop blocked?)",
}


class ModalHandle(SandboxHandle):
    """A running Modal sandbox: the agent's exec stdio as a byte channel."""

    def __init__(self, driver: _Driver, config: SandboxConfig, sandbox_id: str,
                 sandbox: Any, process: Any, pipe: _modal_sdk.StdinPipe) -> None:
        self.sandbox_id = sandbox_id
        self.modal_id = sandbox.object_id
        self.sandbox = sandbox
        self._driver = driver
        self._config = config
        self._process = process
        self._pipe = pipe
        self._reason: str | None = None
        self._stderr = b""
        self._chunks: asyncio.Queue[bytes] = asyncio.Queue()
        self._on_data = self._chunks.put_nowait
        self._on_close = lambda: self._chunks.put_nowait(b"")
        loop = asyncio.get_running_loop()
        self._stdin = loop.create_task(_modal_sdk.run_stdin_stream.aio(process, pipe),
                                       name=f"hermes-modal-tool stdin {sandbox_id}")
        self._stdin.add_done_callback(self._stdin_done)
        self._errors = loop.create_task(self._read_stderr(), name=f"hermes-modal-tool stderr {sandbox_id}")
        self._beat = loop.create_task(self._heartbeat(config.heartbeat_timeout / 6),
                                      name=f"hermes-modal-tool heartbeat {sandbox_id}")
        self._reader: asyncio.Task | None = None

    async def _heartbeat(self, every: float) -> None:
        """Tell the agent the owner is alive (see ``WATCHDOG_SH``): one small frame on the
        open stream every ``every`` seconds, no RPC."""
        frame = protocol.encode({"id": 0, "op": "ping"})
        while not self._pipe.closed:
            await asyncio.sleep(every)
            if not self._pipe.closed:
                self._pipe.write(frame)

    def _stdin_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and self._reason is None:
            log.warning("sandbox %s: the agent's stdin stream broke: %s", self.sandbox_id, task.exception())

    def attach(self, on_data, on_close) -> bool:
        self._on_data, self._on_close = on_data, on_close
        self._reader = asyncio.get_running_loop().create_task(
            self._read_stdout(), name=f"hermes-modal-tool stdout {self.sandbox_id}")
        return True

    async def read(self) -> bytes:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_stdout())
        return await self._chunks.get()

    async def _read_stdout(self) -> None:
        try:
            await _modal_sdk.pump_output.aio(self._process.stdout, asyncio.get_running_loop(),
                                             self._deliver)
            await asyncio.sleep(0)  # chunks handed over just before the end are delivered first
        except asyncio.CancelledError:
            self._reason = self._reason or "the backend stopped"
            raise
        except Exception as exc:  # the stream broke: the sandbox is gone or unreachable
            self._reason = f"lost the agent's output stream ({type(exc).__name__}: {exc})"
        await self._explain()
        self._on_close()

    def _deliver(self, chunk: bytes) -> None:
        self._on_data(chunk)

    async def _read_stderr(self) -> None:
        with contextlib.suppress(Exception):
            async for chunk in self._process.stderr:
                self._stderr = (self._stderr + chunk)[-2000:]

    async def _explain(self) -> None:
        """Ask Modal why the sandbox ended; keep the answer for :meth:`poll`."""
        status, message, code = "running", "", None
        if self._pipe.closed:  # we closed the agent's stdin: it exited because we asked
            self._reason = f"Modal sandbox {self.modal_id}: stopped by the backend"
            return
        for _ in range(5):  # the status may lag the stream's end by a moment
            try:
                status, message, code = await asyncio.wait_for(
                    _modal_sdk.sandbox_result.aio(self.sandbox), 10)
            except Exception as exc:
                message = f"could not ask Modal why ({type(exc).__name__}: {exc})"
                break
            if status != "running":
                break
            await asyncio.sleep(0.05)
        cfg = self._config
        if status in _DEATH_TEXT:
            why = _DEATH_TEXT[status].format(max_lifetime=cfg.max_lifetime, idle_timeout=cfg.idle_timeout,
                                             memory=cfg.memory, heartbeat_timeout=cfg.heartbeat_timeout)
            if code is not None:
                why += f" (exit code {code})"
        else:
            tail = self._stderr.decode("utf-8", "replace").strip().splitlines()
            why = "the agent exited" + (f": {tail[-1]}" if tail else "")
            if tail and "no python3" in tail[-1]:
                why += f"; set add_python (e.g. '3.11') in profile {cfg.name!r}"
        self._reason = f"{why}: {message}" if message and message not in why else why
        self._reason = f"Modal sandbox {self.modal_id}: {self._reason}"

    def write(self, data: bytes) -> None:
        self._pipe.write(data)

    def poll(self) -> str | None:
        return self._reason

    async def terminate(self) -> None:
        self._pipe.close()  # EOF: the agent shuts its slots down and exits
        if self._reader is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(self._reader), 5)
        try:
            await asyncio.wait_for(self.sandbox.terminate.aio(), 30)
        except Exception as exc:
            log.warning("could not terminate Modal sandbox %s: %s", self.modal_id, exc)
        else:
            self._driver._live.pop(self.modal_id, None)
        for task in (self._reader, self._stdin, self._errors, self._beat):
            if task is not None and not task.done():
                task.cancel()
        for task in (self._reader, self._stdin, self._errors, self._beat):
            if task is not None:
                with contextlib.suppress(BaseException):
                    await task
