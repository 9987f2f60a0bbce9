"""Slots (one isolated workspace + shell per trajectory) and tool-call results."""

from __future__ import annotations

import base64
import enum
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any


class SlotState(str, enum.Enum):
    """Where a slot is in its life: free, held by a trajectory, running a call, ..."""

    AVAILABLE = "available"
    ACQUIRED = "acquired"
    EXECUTING = "executing"
    RELEASING = "releasing"
    ERROR = "error"


@dataclass(eq=False)
class Slot:
    """One trajectory's isolated workspace and persistent shell inside a sandbox.

    Attributes:
        slot_id: ``"{sandbox_id}_slot_{N}"``, unique within a backend.
        workspace_dir: the workspace as commands see it, ``{workspace_base}/slot_{N}``.
        state: a :class:`SlotState`.
        trajectory_id: who holds the slot (None when free).
        sandbox_id: the sandbox the slot lives in.
        profile: the profile (pool) it belongs to.
        index: N, the slot's number inside its sandbox.
        error: why the slot is in ``ERROR`` (its sandbox died), else None.
        acquired_at: when it was acquired (``time.time()`` seconds).
        lease_id: this acquisition's id, a random UUID string (``"3f2b...-..."``): unlike
            ``slot_id`` and ``index``, which name the place and come back after a release,
            it is never given out again, so a harness can use it as a sandbox id.
    """

    slot_id: str
    workspace_dir: str
    state: SlotState = SlotState.AVAILABLE
    trajectory_id: str | None = None
    sandbox_id: str = ""
    profile: str = "default"
    index: int = 0
    error: str | None = None
    acquired_at: float | None = None
    lease_id: str = ""
    _lease: int = field(default=0, repr=False)
    _sandbox: Any = field(default=None, repr=False)
    _held_since: float = field(default=0.0, repr=False)  # time.monotonic() at acquire
    _calls: dict[str, int] = field(default_factory=dict, repr=False)  # tool -> calls made

    @property
    def is_available(self) -> bool:
        """True when the slot is free (not held by a trajectory)."""
        return self.state is SlotState.AVAILABLE


#: ``metadata["reason"]`` of a result without an exit code (``returncode`` None):
#: ``bad_request`` (the request or its arguments were refused; nothing ran),
#: ``slot_not_held`` (released, or from another backend), ``sandbox_died`` (before or
#: during the call: whether the command ran is unknown), ``lost`` (no answer came: the
#: same), ``not_run`` (stopped before it started: cancelled, reset, shell not started).
NOT_RUN_REASONS = ("bad_request", "slot_not_held", "sandbox_died", "lost", "not_run")

_IDS: list[str] = []


def execution_id() -> str:
    """A new call's ``execution_id``: 32 random hex characters (128 bits from
    ``os.urandom``, drawn 128 ids at a time: one ``getrandom`` per 128 calls)."""
    try:
        return _IDS.pop()
    except IndexError:
        raw = os.urandom(2048).hex()
        _IDS.extend(raw[i:i + 32] for i in range(32, len(raw), 32))
        return raw[:32]


def execution_ids(n: int) -> list[str]:
    """``n`` new ``execution_id``s (each as :func:`execution_id`'s: 32 random hex
    characters), from one ``os.urandom`` of ``16 * n`` bytes: a batch's in one go."""
    raw = os.urandom(16 * n).hex()
    return [raw[i:i + 32] for i in range(0, 32 * n, 32)]


@dataclass
class ExecutionResult:
    """The result of one tool call.

    Attributes:
        success: True when the call completed and (for ``bash``) exited with 0.
        output: the tool's text output (stdout and stderr interleaved in the order
            they came, for ``bash``; two pipes, so writes to both closer together
            than the agent reads them may change places), capped at the profile's
            ``output_limit`` characters: what the model reads.
        error: why the call failed (None on success); names a timeout, a dead
            sandbox, a bad argument or the exit code.
        execution_id: unique id of this call.
        slot_id: the slot it ran in.
        metadata: ``returncode`` (int; None when no command ran, and then ``reason``
            names why: one of :data:`NOT_RUN_REASONS`), ``duration_s`` (seconds),
            ``timed_out``, ``truncated`` (output or a stream was capped), plus tool
            data (``background``, ``path``, ...; ``stdout_bytes``/``stderr_bytes``,
            the bytes each stream wrote, with ``encoding="bytes"``).
        stdout: a ``bash`` command's standard output alone, capped like ``output``
            (``str``); with the bash argument ``encoding="bytes"`` the exact bytes
            (``bytes``: NUL bytes and invalid UTF-8 kept, nothing replaced), capped
            at the first ``output_limit`` bytes. For other tools: ``output``.
        stderr: the same for standard error (``""``, or ``b""``, when nothing).

    How the two streams cost nothing extra on the common path: in the sandbox,
    stdout and stderr come from two pipes but are stored once, in one head and
    tail buffer in arrival order, with the byte ranges stderr wrote noted beside
    it; ``stdout`` and ``stderr`` are cut from that buffer only when stderr wrote
    something. A command that wrote only to stdout sends nothing more than
    ``output`` (one empty read of its stderr pipe is all it costs), and here
    ``stdout`` is that same ``output`` string, not a copy.
    """

    success: bool
    output: str = ""
    error: str | None = None
    execution_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    slot_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    stdout: str | bytes | None = None
    stderr: str | bytes | None = None

    def __post_init__(self) -> None:
        self.stdout, self.stderr = _defaults(self.success, self.output, self.metadata, self.stdout, self.stderr)

    @property
    def returncode(self) -> int | None:
        """The command's exit code (124 on timeout); None when nothing ran."""
        return self.metadata.get("returncode")

    def to_tool_result(self) -> ToolResult:
        """This result as the original's agent-facing ``ToolResult`` (``error`` is
        ``""`` on success and ``uniq_id`` is the ``execution_id``, as there)."""
        return ToolResult(success=self.success, output=self.output, error=self.error or "",
                          metadata=dict(self.metadata), uniq_id=self.execution_id)

    @classmethod
    def failure(cls, error: str, slot_id: str | None = None, reason: str = "not_run",
                **metadata: Any) -> ExecutionResult:
        """A failed result that never reached (or never came back from) the sandbox:
        ``returncode`` None and ``reason`` one of :data:`NOT_RUN_REASONS`."""
        meta = {"returncode": None, "reason": reason, "duration_s": 0.0, "timed_out": False,
                "truncated": False}
        meta.update(metadata)
        return cls(success=False, error=error, slot_id=slot_id, metadata=meta)

    @classmethod
    def from_agent(cls, result: dict[str, Any], slot_id: str, execution_id: str,
                   tool: str) -> ExecutionResult:
        """Build from the agent's ``call`` result (see :mod:`hermes_modal_tool.protocol`; a
        ``results`` frame's compact result too: a key left out has its default).

        The same result as the constructor with these fields, made without it: the
        dataclass ``__init__`` with keywords and ``__post_init__`` cost about 1 µs of the
        host's event loop per call, a tenth of what a grouped call costs it there
        (``benchmarks/_scaling.py``); so ``__post_init__``'s rules are applied here and
        the fields set on a bare instance (a subclass goes through its constructor); a
        result of output, exit code and run time alone (most calls) in fewer steps."""
        if cls is ExecutionResult and result.keys() <= _PLAIN_KEYS:
            rc = result.get("returncode")
            output = result.get("output", "")
            error = f"exit code {rc}" if rc not in (0, None) and tool == "bash" else None
            # __post_init__ adds nothing here: an error has an exit code, so no "reason".
            return _made(error is None, output, error, execution_id, slot_id,
                         {"returncode": rc, "duration_s": result.get("duration_s", 0.0),
                          "timed_out": False, "truncated": False},
                         output, b"" if isinstance(output, bytes) else "")
        get = result.get
        rc = get("returncode")
        error = get("error")
        if error is None and rc not in (0, None) and tool == "bash":
            error = f"exit code {rc}"
        meta = {"returncode": rc, "duration_s": get("duration_s", 0.0),
                "timed_out": bool(get("timed_out")), "truncated": bool(get("truncated"))}
        data = get("data")
        if data:
            meta.update(data)
        output = get("output", "")
        stdout, stderr = get("stdout"), get("stderr")
        if "stdout_b64" in result:
            stdout = base64.b64decode(result["stdout_b64"])
            stderr = base64.b64decode(get("stderr_b64") or "")
            meta["stdout_bytes"] = get("stdout_bytes", len(stdout))
            meta["stderr_bytes"] = get("stderr_bytes", len(stderr))
        success = error is None
        if cls is not ExecutionResult:
            return cls(success=success, output=output, error=error, execution_id=execution_id,
                       slot_id=slot_id, metadata=meta, stdout=stdout, stderr=stderr)
        stdout, stderr = _defaults(success, output, meta, stdout, stderr)
        return _made(success, output, error, execution_id, slot_id, meta, stdout, stderr)


def _defaults(success: bool, output: str, meta: dict[str, Any], stdout: str | bytes | None,
              stderr: str | bytes | None) -> tuple[str | bytes, str | bytes]:
    """``ExecutionResult.__post_init__``'s rules: ``meta`` given its ``returncode`` (and,
    failed with none, ``reason: not_run``); ``(stdout, stderr)`` given their defaults."""
    if meta.get("returncode") is None:
        meta.setdefault("returncode", None)
        if not success:
            meta.setdefault("reason", "not_run")
    if stdout is None:
        stdout = output
    if stderr is None:
        stderr = b"" if isinstance(stdout, bytes) else ""
    return stdout, stderr


def _made(success: bool, output: str, error: str | None, execution_id: str, slot_id: str | None,
          metadata: dict[str, Any], stdout: str | bytes, stderr: str | bytes) -> ExecutionResult:
    """An ExecutionResult of these fields, made without the dataclass constructor (the
    caller applied :func:`_defaults`): the fields set in their order on a bare instance."""
    self = _new(ExecutionResult)
    self.success = success
    self.output = output
    self.error = error
    self.execution_id = execution_id
    self.slot_id = slot_id
    self.metadata = metadata
    self.stdout = stdout
    self.stderr = stderr
    return self


_new = object.__new__
#: The keys of a compact result that ``from_agent`` makes in fewer steps.
_PLAIN_KEYS = frozenset(("output", "returncode", "duration_s"))


@dataclass(frozen=True)
class OutputEvent:
    """Output a running call wrote, as it came (see ``ToolBackend.execute_stream`` and
    the ``on_output`` argument of ``execute``/``execute_batch``).

    Attributes:
        index: the call's position in its ``execute_batch`` request list (0 for ``execute``).
        slot_id: the slot it runs in.
        stream: ``"stdout"`` or ``"stderr"``.
        data: the chunk: ``str`` (decoded per stream; a character cut between two
            reads is not replaced), ``bytes`` with the bash argument ``encoding="bytes"``.
    """

    index: int
    slot_id: str
    stream: str
    data: str | bytes


@dataclass
class ToolResult:
    """A tool call's result as an agent loop consumes it (the original Atropos shape).

    Attributes:
        success: as :attr:`ExecutionResult.success`.
        output: the tool's text output.
        error: why it failed; ``""`` on success.
        metadata: ``returncode``, ``duration_s``, ``timed_out``, ... (see ExecutionResult).
        uniq_id: the call's id (the ``execution_id``; Hermes matches it to its tool call).
    """

    success: bool
    output: str = ""
    error: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    uniq_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """``{"success", "output", "error", "metadata", "uniq_id"}``."""
        return {"success": self.success, "output": self.output, "error": self.error,
                "metadata": self.metadata, "uniq_id": self.uniq_id}

    def to_xml(self) -> str:
        """``<tool_response>{json}</tool_response>`` as Hermes-style prompts include it
        (``error``, ``metadata`` and ``uniq_id`` only when set)."""
        data: dict[str, Any] = {"success": self.success, "output": self.output}
        if self.uniq_id:
            data["uniq_id"] = self.uniq_id
        if self.error:
            data["error"] = self.error
        if self.metadata:
            data["metadata"] = self.metadata
        return f"<tool_response>{json.dumps(data, default=str)}</tool_response>"


def now() -> float:
    return time.monotonic()
