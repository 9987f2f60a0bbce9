"""Processes of a slot beside its shell: interactive programs on a PTY, or long jobs on
pipes, that a program writes to and reads from while they run (as E2B's and Modal's
``exec`` handles). The agent's side: ``hermes_modal_tool/agent/shells/ptyprocs.py``.

Example:
    >>> async def repl(backend, slot):
    ...     proc = await backend.start_process(slot, "python3 -q", rows=24, cols=80)
    ...     await proc.write("print(6 * 7)\\n")
    ...     out = await proc.read_until(b"42")
    ...     await proc.write("exit()\\n")
    ...     return await proc.wait(timeout_s=10)  # 0
"""

from __future__ import annotations

import base64
import signal as _signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import SandboxError, UsageError
from .slots import Slot

if TYPE_CHECKING:
    from ._backend_view import BackendView

#: Seconds beyond a request's own wait the host gives the agent to answer.
ANSWER_S = 30.0


@dataclass(eq=False)
class SlotProcess:
    """A process started by :meth:`ToolBackend.start_process` in ``slot``.

    Attributes:
        slot: the slot it runs in; releasing the slot kills it.
        id: its number in the sandbox.
        pid: its pid as the slot sees it.
        pty: whether it runs on a terminal.
        command: the command line.
    """

    slot: Slot
    id: int
    pid: int
    pty: bool
    command: str
    _backend: BackendView = field(repr=False)

    async def _ask(self, action: str, within: float = 0.0, **fields: Any) -> dict[str, Any]:
        return await self._backend._process_request(self.slot, action, within, process=self.id, **fields)

    async def write(self, data: str | bytes, eof: bool = False) -> None:
        """Send ``data`` to its input (on a PTY, ``"\\x03"`` is Ctrl-C and ``"\\x04"``
        Ctrl-D); ``eof``: then end its input.

        Raises:
            SandboxError: it has ended, or has not read 1 MiB of earlier input.
        """
        payload: dict[str, Any] = {"eof": eof}
        if isinstance(data, bytes):
            payload["data_b64"] = base64.b64encode(data).decode("ascii")
        else:
            payload["data"] = data
        await self._ask("write", **payload)

    async def read(self, wait_s: float = 0.0) -> bytes:
        """The output that came since the previous read (its last MiB is kept); waits up to
        ``wait_s`` seconds for some when there is none. ``b""``: none came (or it ended)."""
        return base64.b64decode((await self._ask("read", wait_s, wait_s=wait_s))["data_b64"])

    async def read_until(self, needle: bytes, timeout_s: float = 30.0) -> bytes:
        """Read until the output read so far contains ``needle``; return all of it.

        Raises:
            SandboxError: ``needle`` did not come within ``timeout_s`` seconds (the
                message shows the end of what came).
        """
        got = b""
        deadline = time.monotonic() + timeout_s
        while needle not in got:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SandboxError(f"process {self.id}: {needle!r} did not come within {timeout_s:g}s; "
                                   f"its output ends with {got[-200:]!r}")
            answer = await self._ask("read", min(left, 5.0), wait_s=min(left, 5.0))
            got += base64.b64decode(answer["data_b64"])
            if not answer["running"] and not answer["data_b64"] and needle not in got:
                raise SandboxError(f"process {self.id} ended (exit code {answer['returncode']}) "
                                   f"before {needle!r} came; its output ends with {got[-200:]!r}")
        return got

    async def resize(self, rows: int, cols: int) -> None:
        """Set its terminal's size (the program gets SIGWINCH)."""
        await self._ask("resize", rows=rows, cols=cols)

    async def signal(self, sig: int | str = "SIGTERM") -> None:
        """Send a signal (a number, or a name such as ``"SIGINT"``/``"INT"``) to its
        process group.

        Raises:
            UsageError: an unknown signal name.
        """
        if isinstance(sig, str):
            name = sig.upper() if sig.upper().startswith("SIG") else "SIG" + sig.upper()
            try:
                sig = int(getattr(_signal, name))
            except AttributeError:
                raise UsageError(f"unknown signal {sig!r}") from None
        await self._ask("signal", signal=int(sig))

    async def wait(self, timeout_s: float | None = None) -> int | None:
        """Wait for it to end; its exit code (``-N`` when killed by signal N), or None if it
        still runs after ``timeout_s`` seconds (default: wait up to an hour)."""
        limit = 3600.0 if timeout_s is None else float(timeout_s)
        answer = await self._ask("wait", limit, timeout_s=limit)
        return None if answer["running"] else answer["returncode"]


class ProcessMethods:
    """Mixed into :class:`~hermes_modal_tool.backend.ToolBackend`."""

    if TYPE_CHECKING:
        _pools: dict[str, Any]

        def _check_open(self) -> None: ...

        async def execute(self, slot: Slot, tool: str, args: Mapping[str, Any],
                          timeout_s: float | None = None, on_output: Any = None) -> Any: ...

    async def start_process(self, slot: Slot, command: str, *, pty: bool = True, rows: int = 24,
                            cols: int = 80, env: Mapping[str, str] | None = None) -> SlotProcess:
        """Start ``command`` in ``slot`` beside its shell (which stays free for calls), in the
        shell's working directory with its exported variables; on a terminal of ``rows``
        x ``cols`` when ``pty``, else on pipes (stdout and stderr together). Releasing the
        slot kills it. Needs ``python3`` in the slot.

        Raises:
            UsageError: the slot is not held, or bad sizes.
            SandboxError: it could not be started (the message says why).
        """
        self._check_open()
        for name, value in (("rows", rows), ("cols", cols)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 65536:
                raise UsageError(f"{name} must be a whole number from 1 to 65535, got {value!r}")
        args: dict[str, Any] = {"command": command, "pty": bool(pty), "rows": rows, "cols": cols}
        if env:
            args["env"] = dict(env)
        r = await self.execute(slot, "bash", args)
        info = r.metadata.get("process")
        if not r.success or not isinstance(info, dict):
            raise SandboxError(f"could not start {command!r:.80} in slot {slot.slot_id}: {r.error}")
        return SlotProcess(slot, int(info["id"]), int(info["pid"]), bool(info["pty"]), command, self)  # type: ignore[arg-type]

    async def process(self, slot: Slot, process_id: int) -> SlotProcess:
        """A handle on process ``process_id`` of ``slot``: one a ``bash`` call started
        (``pty: true`` or ``background: true``: its result's ``metadata["process"]["id"]``)
        or one :meth:`list_processes` shows.

        Raises:
            SandboxError: the slot has no such process (never started, or released).
        """
        for info in await self.list_processes(slot):
            if info["id"] == process_id:
                return SlotProcess(slot, info["id"], info["pid"], info["pty"], info["command"], self)  # type: ignore[arg-type]
        raise SandboxError(f"slot {slot.slot_id} has no process {process_id!r}")

    async def list_processes(self, slot: Slot) -> list[dict[str, Any]]:
        """The slot's processes: ``id``, ``pid``, ``command``, ``pty``, ``running``,
        ``returncode``."""
        return (await self._process_request(slot, "list", 0.0))["processes"]

    async def _process_request(self, slot: Slot, action: str, within: float, **fields: Any) -> dict[str, Any]:
        self._check_open()
        pool = self._pools.get(slot.profile)
        if pool is None:
            raise UsageError(f"slot {slot.slot_id} does not belong to this backend")
        rec = pool.record_of(slot)
        reply = await rec.sandbox.request({"op": "process", "slot": rec.index, "action": action, **fields},
                                          within + ANSWER_S)
        if not reply.get("ok"):
            raise SandboxError(f"slot {slot.slot_id}: {reply.get('error')}")
        return reply["result"]
