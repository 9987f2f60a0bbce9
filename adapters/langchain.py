"""LangChain and Deep Agents adapters: sandboxed ``bash``, ``read_file`` and ``write_file``.

Three LangChain tools (:class:`BashTool`, :class:`ReadFileTool`,
:class:`WriteFileTool`) whose name, description and argument schema come from
:data:`hermes_modal_tool.tools.TOOL_SPECS`; a toolkit (:class:`SandboxToolkit`)
binding them to one backend; and :class:`SlotSandbox`, a Deep Agents sandbox
backend (``create_deep_agent(backend=SlotSandbox(...))``) on a slot.

Which slot a call runs in: the fixed ``trajectory_id`` when one is given, else the
LangGraph ``thread_id`` of the run (``config["configurable"]["thread_id"]``), else
one slot per toolkit. A key keeps its slot, so ``cd``, ``export`` and files persist
between calls, until :meth:`SandboxToolkit.aclose`.

Tools return ``(content, artifact)`` (``response_format="content_and_artifact"``):
the content is short text for the model (output plus exit code or error), the
artifact the :class:`~hermes_modal_tool.ExecutionResult`. A non-zero exit, a
timeout (exit code 124) or a bad path is tool output the model reads, not an
exception.

Streaming: an async ``bash`` call (``ainvoke``, ``astream_events``, an agent's
``astream``) dispatches the command's output as it comes, as LangChain custom events
named :data:`OUTPUT_EVENT` (``{"stream": "stdout"|"stderr", "data": str}``, in
``astream_events`` as ``on_custom_event`` of the tool's run); the tool's result is
unchanged. Sync calls do not stream.

Async calls (``ainvoke``) await the engine; sync calls (``invoke``) run it on the
process's one background loop (:func:`hermes_modal_tool.portal.run_sync`). A
backend lives on the event loop it was started on: start it with
``run_sync(backend.start())`` to use it from sync code and from any loop, or
``await backend.start()`` and call the tools with ``ainvoke`` on that loop.

Example:
    >>> from hermes_modal_tool import SandboxConfig, ToolBackend
    >>> from hermes_modal_tool.portal import run_sync
    >>> from hermes_modal_tool.adapters.langchain import SandboxToolkit
    >>> backend = ToolBackend(SandboxConfig(slots_per_sandbox=4))
    >>> run_sync(backend.start())  # doctest: +SKIP
    >>> bash, read_file, write_file = SandboxToolkit(backend).get_tools()
    >>> cfg = {"configurable": {"thread_id": "t1"}}
    >>> bash.invoke({"command": "mkdir p && cd p"}, cfg)  # doctest: +SKIP
    '(no output)\\n[exit code 0]'
    >>> bash.invoke({"command": "pwd"}, cfg)  # doctest: +SKIP
    '/data/slot_0/p\\n[exit code 0]'
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar, Literal

from langchain_core.callbacks import AsyncCallbackManagerForToolRun, adispatch_custom_event
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, BaseToolkit
from pydantic import BaseModel, ConfigDict, Field, model_validator

from hermes_modal_tool.backend import ToolBackend
from hermes_modal_tool.errors import PoolTimeoutError, SandboxError
from hermes_modal_tool.sessions import SlotSessions
from hermes_modal_tool.slots import ExecutionResult, Slot
from hermes_modal_tool.tools import TOOL_SPECS, read_file_text

from .backend_calls import NO_TIMEOUT_S as NO_TIMEOUT_S
from .backend_calls import acall as _acall
from .backend_calls import call as _call
from .backend_calls import new_key as _new_key
from .backend_calls import thread_key as _thread_key

__all__ = ["OUTPUT_EVENT", "BashTool", "ReadFileTool", "SandboxToolkit", "SlotSandbox", "WriteFileTool"]

#: Name of the custom events that carry a running ``bash`` call's output.
OUTPUT_EVENT = "hermes_modal_tool.output"


#: Built on first access (see ``__getattr__`` at the end): importing Deep Agents takes seconds.
SlotSandbox: type[Any]

async def _run_tool(sessions: SlotSessions, key: str, tool: str, args: dict[str, Any],
                    profile: str | None, timeout_s: float | None, on_output: Any = None) -> ExecutionResult:
    """One call in ``key``'s slot; a busy pool or a lost sandbox becomes a failed result."""
    try:
        return await sessions.execute(key, tool, args, timeout_s=timeout_s, profile=profile,
                                      on_output=on_output)
    except (PoolTimeoutError, SandboxError) as exc:
        return ExecutionResult.failure(f"{type(exc).__name__}: {exc}")


# -- LangChain tools -------------------------------------------------------------------

class _SlotTool(BaseTool):
    """A TOOL_SPECS tool run in a slot of a backend (see the module docstring)."""

    spec_name: ClassVar[str]
    response_format: Literal["content", "content_and_artifact"] = "content_and_artifact"

    backend: ToolBackend | None = Field(default=None, exclude=True, description="The engine.")
    sessions: SlotSessions | None = Field(
        default=None, exclude=True, description="Key -> slot map; shared by a toolkit's tools.")
    trajectory_id: str | None = Field(
        default=None, description="Run every call in this key's slot (else: the thread_id).")
    profile: str | None = Field(default=None, description="Profile to acquire slots from.")
    timeout_s: float | None = Field(default=None, gt=0, description="Per-call timeout, seconds.")
    default_key: str = Field(default_factory=_new_key,
                             description="The key of calls with neither trajectory_id nor thread_id.")

    @model_validator(mode="after")
    def _bind(self) -> _SlotTool:
        if self.sessions is None:
            if self.backend is None:
                raise ValueError(f"{type(self).__name__} needs backend= or sessions=")
            self.sessions = SlotSessions(self.backend)
        elif self.backend is None:
            self.backend = self.sessions.backend
        elif self.sessions.backend is not self.backend:
            raise ValueError("sessions belong to another backend")
        return self

    def key(self, config: RunnableConfig | None = None) -> str:
        """The slot key of a call made with ``config``."""
        return self.trajectory_id or _thread_key(config) or self.default_key

    def _run(self, config: RunnableConfig, **kwargs: Any) -> tuple[str, ExecutionResult]:
        return _call(self.backend, self._call_engine(config, kwargs))

    async def _arun(self, config: RunnableConfig, run_manager: AsyncCallbackManagerForToolRun | None = None,
                    **kwargs: Any) -> tuple[str, ExecutionResult]:
        if self.spec_name != "bash" or run_manager is None or not run_manager.handlers:  # nobody listens
            return await _acall(self.backend, self._call_engine(config, kwargs))
        events_config: RunnableConfig = {"callbacks": run_manager.get_child()}  # of this tool's run
        # The engine may run on another loop (the backend's): events come back through
        # call_soon_threadsafe, in order, all before the result; one task forwards them.
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def on_output(event: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        async def forward() -> None:
            while (event := await queue.get()) is not None:
                await adispatch_custom_event(OUTPUT_EVENT, {"stream": event.stream, "data": event.data},
                                             config=events_config)

        forwarder = asyncio.ensure_future(forward())
        try:
            return await _acall(self.backend, self._call_engine(config, kwargs, on_output))
        finally:
            loop.call_soon(queue.put_nowait, None)  # after the events already scheduled
            await forwarder

    async def _call_engine(self, config: RunnableConfig, kwargs: dict[str, Any],
                           on_output: Any = None) -> tuple[str, ExecutionResult]:
        spec = TOOL_SPECS[self.spec_name]
        result = await _run_tool(self.sessions, self.key(config), spec.name, spec.engine_args(kwargs),
                                 self.profile, self.timeout_s, on_output)
        return self.format_result(result), result

    @staticmethod
    def format_result(result: ExecutionResult) -> str:
        """The text the model reads."""
        if result.success:
            return result.output
        return f"Error: {result.error}"


class BashTool(_SlotTool):
    """The ``bash`` tool: a command in the slot's persistent shell.

    Content: the output, then ``[exit code N]`` (and the error, e.g. a timeout).
    """

    spec_name: ClassVar[str] = "bash"
    name: str = TOOL_SPECS["bash"].name
    description: str = TOOL_SPECS["bash"].description
    args_schema: type[BaseModel] = TOOL_SPECS["bash"].args_model

    @staticmethod
    def format_result(result: ExecutionResult) -> str:
        rc = result.returncode
        out = result.output.rstrip("\n") or "(no output)"
        status = f"exit code {rc}" if rc is not None else "error"
        if result.error and result.error != f"exit code {rc}":
            status += f": {result.error}"
        return f"{out}\n[{status}]"


class ReadFileTool(_SlotTool):
    """The ``read_file`` tool: the file's text (or ``Error: ...``)."""

    spec_name: ClassVar[str] = "read_file"
    name: str = TOOL_SPECS["read_file"].name
    description: str = TOOL_SPECS["read_file"].description
    args_schema: type[BaseModel] = TOOL_SPECS["read_file"].args_model

    @staticmethod
    def format_result(result: ExecutionResult) -> str:
        if result.success:
            return read_file_text(result.output, result.metadata)
        return f"Error: {result.error}"


class WriteFileTool(_SlotTool):
    """The ``write_file`` tool: ``wrote N bytes to PATH`` (or ``Error: ...``)."""

    spec_name: ClassVar[str] = "write_file"
    name: str = TOOL_SPECS["write_file"].name
    description: str = TOOL_SPECS["write_file"].description
    args_schema: type[BaseModel] = TOOL_SPECS["write_file"].args_model


_TOOL_CLASSES: dict[str, type[_SlotTool]] = {
    cls.spec_name: cls for cls in (BashTool, ReadFileTool, WriteFileTool)}


class SandboxToolkit(BaseToolkit):
    """``bash``, ``read_file`` and ``write_file`` bound to one backend and one trajectory
    (or one slot per LangGraph thread), like LangChain's other toolkits.

    Args:
        backend: the engine (see the module docstring for which loop it runs on).
        trajectory_id: run every call in this key's slot; None: the run's
            ``thread_id`` picks the slot (one toolkit-wide slot when there is none).
        profile: the profile slots come from (default: the backend's).
        timeout_s: per-call timeout (default: the profile's ``execution_timeout_s``;
            a bash call's own ``timeout`` wins).
        tools: which of ``bash``, ``read_file``, ``write_file`` to give out.
        sessions: a :class:`SlotSessions` to share (e.g. with a :class:`SlotSandbox`).
        idle_release_s: release a key's slot after this many idle seconds (checked
            on the next call; None: keep it until :meth:`close`). For servers with
            many short threads.

    Example:
        >>> toolkit = SandboxToolkit(backend)  # doctest: +SKIP
        >>> agent = create_agent(model, toolkit.get_tools())  # doctest: +SKIP
        >>> agent.invoke({"messages": [...]}, {"configurable": {"thread_id": "a"}})  # doctest: +SKIP
        >>> toolkit.close()  # doctest: +SKIP
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    backend: ToolBackend
    trajectory_id: str | None = None
    profile: str | None = None
    timeout_s: float | None = Field(default=None, gt=0)
    tools: tuple[str, ...] = ("bash", "read_file", "write_file")
    sessions: SlotSessions | None = None
    idle_release_s: float | None = Field(default=None, gt=0)
    default_key: str = Field(default_factory=_new_key)

    def __init__(self, backend: ToolBackend, trajectory_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(backend=backend, trajectory_id=trajectory_id, **kwargs)

    @model_validator(mode="after")
    def _bind(self) -> SandboxToolkit:
        unknown = set(self.tools) - set(_TOOL_CLASSES)
        if unknown:
            raise ValueError(f"unknown tools {sorted(unknown)}; known: {sorted(_TOOL_CLASSES)}")
        if self.sessions is None:
            self.sessions = SlotSessions(self.backend, lifetime_s=self.idle_release_s)
        elif self.sessions.backend is not self.backend:
            raise ValueError("sessions belong to another backend")
        return self

    def get_tools(self) -> list[BaseTool]:
        """The tools, sharing this toolkit's slots."""
        return [_TOOL_CLASSES[name](sessions=self.sessions, trajectory_id=self.trajectory_id,
                                    profile=self.profile, timeout_s=self.timeout_s,
                                    default_key=self.default_key)
                for name in self.tools]

    def key(self, config: RunnableConfig | None = None) -> str:
        """The slot key of a call made with ``config`` (or of ``trajectory_id``)."""
        return self.trajectory_id or _thread_key(config) or self.default_key

    async def aslot(self, config: RunnableConfig | None = None) -> Slot:
        """The slot calls with ``config`` run in (acquired now if needed)."""
        return await _acall(self.backend, self.sessions.slot(self.key(config), self.profile))

    def slot(self, config: RunnableConfig | None = None) -> Slot:
        """Sync :meth:`aslot`."""
        return _call(self.backend, self.sessions.slot(self.key(config), self.profile))

    async def aclose(self, config: RunnableConfig | None = None) -> int:
        """Release the slot of ``config``'s key, or every slot when None; return how many."""
        if config is None:
            return await _acall(self.backend, self.sessions.close_all())
        return int(await _acall(self.backend, self.sessions.close(self.key(config))))

    def close(self, config: RunnableConfig | None = None) -> int:
        """Sync :meth:`aclose`."""
        if config is None:
            return _call(self.backend, self.sessions.close_all())
        return int(_call(self.backend, self.sessions.close(self.key(config))))

    def info(self) -> dict[str, dict[str, Any]]:
        """Per key: slot id, workspace, profile, seconds idle, state."""
        return self.sessions.info()


def __getattr__(name: str) -> Any:
    if name == "SlotSandbox":
        from ._slot_sandbox import slot_sandbox_class

        cls = slot_sandbox_class()
        globals()["SlotSandbox"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
