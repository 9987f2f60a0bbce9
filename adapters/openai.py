"""OpenAI function calling: tool definitions and a dispatcher that runs the calls.

:func:`openai_tools` gives the ``bash``, ``read_file`` and ``write_file`` tools
(from :data:`hermes_modal_tool.tools.TOOL_SPECS`, the one contract every adapter
shares) in the shape of the Chat Completions API or of the Responses API.
:class:`ToolDispatcher` takes what the SDK returns for one model turn, runs its
function calls in the conversation's slot (one slot per conversation id), and
returns the messages to send back. The ``openai`` package is not imported here:
SDK objects and plain dicts are both accepted.

Example (Chat Completions, async client)::

    backend = ToolBackend(SandboxConfig(slots_per_sandbox=4))
    await backend.start()
    dispatcher = ToolDispatcher(backend)
    tools = openai_tools("chat")
    messages = [{"role": "user", "content": "Create proj/ and show its path"}]
    while True:
        completion = await client.chat.completions.create(
            model="gpt-4.1", messages=messages, tools=tools)
        message = completion.choices[0].message
        messages.append(message)
        results = await dispatcher.handle(message, conversation_id="conv-1")
        if not results:
            break                      # no tool calls: message.content is the answer
        messages.extend(results)
    await dispatcher.close_all()
    await backend.stop()
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from ..backend import ToolBackend
from ..errors import UsageError
from ..portal import run_sync
from ..sessions import SlotSessions
from ..slots import ExecutionResult
from ..tools import TOOL_SPECS, read_file_text

__all__ = ["ToolCallOutcome", "ToolDispatcher", "format_result", "openai_tools"]

Api = Literal["chat", "responses"]


def openai_tools(api: Api = "chat", strict: bool = True) -> list[dict[str, Any]]:
    """The sandbox tools as OpenAI function tool definitions.

    Args:
        api: ``"chat"`` for Chat Completions (``{"type": "function", "function":
            {...}}``) or ``"responses"`` for the Responses API (flat
            ``{"type": "function", "name", ...}``).
        strict: use strict mode (structured outputs): every property required,
            optional values nullable, no extra properties. With ``False`` the
            plain argument schema (with defaults) is sent and ``strict`` is
            ``False`` (the Responses API would otherwise default to strict).

    Returns:
        One definition per tool, ready for ``tools=``.

    Raises:
        UsageError: ``api`` is neither ``"chat"`` nor ``"responses"``.

    Examples:
        >>> [t["function"]["name"] for t in openai_tools("chat")]
        ['bash', 'read_file', 'write_file']
        >>> openai_tools("responses")[0]["parameters"]["additionalProperties"]
        False
    """
    if api not in ("chat", "responses"):
        raise UsageError(f"api must be 'chat' or 'responses', got {api!r}")
    out: list[dict[str, Any]] = []
    for spec in TOOL_SPECS.values():
        function = {"name": spec.name, "description": spec.description,
                    "parameters": spec.strict_json_schema() if strict else spec.json_schema(),
                    "strict": bool(strict)}
        out.append({"type": "function", "function": function} if api == "chat"
                   else {"type": "function", **function})
    return out


@dataclass(frozen=True)
class _Call:
    call_id: str
    name: str
    arguments: Any  # the raw JSON string (or an already-decoded dict from plain-dict callers)
    kind: str = "function"


def _parse_tool_calls(response: Any) -> tuple[Api, list[_Call]]:
    """Find the function calls in what the SDK returned for one model turn.

    Accepts a ``ChatCompletion``, a ``ChatCompletionMessage`` (or its dict), a list
    of chat tool calls, a Responses ``Response``, its ``output`` list or one
    ``function_call`` item, as SDK objects or plain dicts. For a ``ChatCompletion``
    the first choice is used. Responses items other than ``function_call``
    (messages, reasoning) are skipped. A whole history (a list holding tool results)
    is refused, so that calls already answered never run twice.

    Returns:
        ``("chat" | "responses", calls)`` in the order the model made them.

    Raises:
        UsageError: the value is none of the shapes above.
    """
    data = _plain(response)
    if isinstance(data, Mapping):
        if "choices" in data:  # ChatCompletion
            choices = data["choices"] or []
            return "chat", _chat_calls(_plain(_plain(choices[0]).get("message")) if choices else {})
        if isinstance(data.get("output"), list):  # Response
            return "responses", _responses_calls(data["output"])
        if data.get("type") == "function_call":
            return "responses", _responses_calls([data])
        if "tool_calls" in data or data.get("role") == "assistant":
            return "chat", _chat_calls(data)
        if "function" in data or "custom" in data:
            return "chat", _chat_calls({"tool_calls": [data]})
    elif isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        items = [_plain(x) for x in data]
        if any(isinstance(x, Mapping) and (x.get("type") == "function_call_output" or x.get("role") == "tool"
                                           or x.get("tool_calls")) for x in items):
            # A whole history: its calls were answered already and must not run again.
            raise UsageError("pass the latest model turn (the assistant message or response.output), "
                             "not the whole conversation: calls already answered would run again")
        if items and all(isinstance(x, Mapping) and ("function" in x or "custom" in x) for x in items):
            return "chat", _chat_calls({"tool_calls": items})
        if all(isinstance(x, Mapping) for x in items):
            return "responses", _responses_calls(items)
    raise UsageError(
        "expected a ChatCompletion, a ChatCompletionMessage, a Response, a Response's output "
        f"list or their dicts; got {type(response).__name__}")


def _plain(obj: Any) -> Any:
    """SDK objects (pydantic models) as dicts; anything else unchanged."""
    dump = getattr(obj, "model_dump", None)
    return dump() if callable(dump) else obj


def _chat_calls(message: Any) -> list[_Call]:
    calls = []
    raw_calls = (message or {}).get("tool_calls") or []
    if not isinstance(raw_calls, Sequence) or isinstance(raw_calls, (str, bytes)):
        raise UsageError(f"tool_calls must be a list of tool calls, got {raw_calls!r:.80}")
    for raw in raw_calls:
        tc = _plain(raw)
        if not isinstance(tc, Mapping):
            raise UsageError(f"a tool call must be an object with id/type/function, got {tc!r:.80}")
        if tc.get("type", "function") == "function" and tc.get("function") is not None:
            fn = _plain(tc["function"])
            if not isinstance(fn, Mapping):
                raise UsageError(f"a tool call's function must be an object, got {fn!r:.80}")
            calls.append(_Call(str(tc.get("id")), str(fn.get("name")), fn.get("arguments")))
        else:  # a custom (free-form) tool call still needs an answer in chat
            name = (_plain(tc.get("custom")) or {}).get("name", "?")
            calls.append(_Call(str(tc.get("id")), str(name), None, kind=str(tc.get("type"))))
    return calls


def _responses_calls(items: Sequence[Any]) -> list[_Call]:
    calls = []
    for raw in items:
        item = _plain(raw)
        if isinstance(item, Mapping) and item.get("type") == "function_call":
            calls.append(_Call(str(item.get("call_id")), str(item.get("name")), item.get("arguments")))
    return calls


@dataclass(frozen=True)
class ToolCallOutcome:
    """One function call of a turn: what the model asked, what ran, what it is told.

    Attributes:
        call_id: the call's id (``tool_call_id`` / ``call_id``).
        name: the function name the model used.
        arguments: the validated engine arguments, or None when the call was refused.
        result: the engine's :class:`ExecutionResult`, or None when nothing ran.
        error: why the call was refused (bad JSON, bad arguments, unknown function).
        message: the message to send back to the model.
    """

    call_id: str
    name: str
    arguments: dict[str, Any] | None
    result: ExecutionResult | None
    error: str | None
    message: dict[str, Any]


class ToolDispatcher:
    """Run a model turn's function calls in the conversation's slot.

    Like the tool-execution half of OpenAI's agent loop: hand it what
    ``client.chat.completions.create`` or ``client.responses.create`` returned and
    extend your ``messages`` / ``input`` with what it gives back. Each conversation
    id holds one slot (via :class:`~hermes_modal_tool.sessions.SlotSessions`), so
    ``cd``, ``export`` and files persist between turns; the calls of one turn run as
    one batch, in the order the model made them. Calls the model got wrong (bad JSON,
    arguments that fail the schema, an unknown function) are answered with a message
    saying what was wrong and run nothing; the other calls of the turn still run.

    Args:
        backend: a started engine.
        sessions: the conversation-to-slot map to use (default: a new one on ``backend``).
        profile: the profile whose pool conversations take slots from (default profile if None).
        timeout_s: default per-call timeout (a bash call's own ``timeout`` wins).

    The sync :meth:`handle_sync` runs on the process's portal loop
    (:func:`hermes_modal_tool.portal.run_sync`); the backend must then have been
    started there too: ``run_sync(backend.start())``.
    """

    def __init__(self, backend: ToolBackend, *, sessions: SlotSessions | None = None,
                 profile: str | None = None, timeout_s: float | None = None) -> None:
        self.backend = backend
        self.sessions = sessions if sessions is not None else SlotSessions(backend)
        self.profile = profile
        self.timeout_s = timeout_s

    async def dispatch(self, response: Any, conversation_id: str) -> list[ToolCallOutcome]:
        """Like :meth:`handle`, with the engine results next to each message."""
        if not isinstance(conversation_id, str) or not conversation_id:
            raise UsageError(f"conversation_id must be a non-empty string, got {conversation_id!r}")
        api, calls = _parse_tool_calls(response)
        checked = [_check(call) for call in calls]
        runnable = [(call.name, args) for call, (args, error) in zip(calls, checked, strict=True)
                    if error is None]
        results = iter(await self.sessions.execute_many(conversation_id, runnable, timeout_s=self.timeout_s,
                                                        profile=self.profile) if runnable else [])
        outcomes = []
        for call, (args, error) in zip(calls, checked, strict=True):
            result = next(results) if error is None else None
            content = format_result(call.name, result) if result is not None else str(error)
            outcomes.append(ToolCallOutcome(call.call_id, call.name, args, result, error,
                                            _reply(api, call.call_id, content)))
        return outcomes

    async def handle(self, response: Any, conversation_id: str) -> list[dict[str, Any]]:
        """Run the function calls in ``response`` in ``conversation_id``'s slot.

        Args:
            response: what the SDK returned for one model turn, as an SDK object or a
                plain dict: a ``ChatCompletion`` (its first choice), a
                ``ChatCompletionMessage``, a list of chat tool calls, a ``Response``, its
                ``output`` list or one ``function_call`` item. Only function calls run;
                other Responses items (messages, reasoning) are skipped.
            conversation_id: the conversation's key; the same key gets the same slot.

        Returns:
            The messages to send back, one per call in call order:
            ``{"role": "tool", "tool_call_id", "content"}`` (chat) or
            ``{"type": "function_call_output", "call_id", "output"}`` (responses).
            Empty when the model made no function call (its turn is the answer).

        Raises:
            UsageError: ``response`` has no recognisable shape, or a bad conversation id.
            PoolTimeoutError: no slot was free for a new conversation in time.
            BackendClosedError: the backend was stopped.
        """
        return [o.message for o in await self.dispatch(response, conversation_id)]

    def handle_sync(self, response: Any, conversation_id: str,
                    timeout: float | None = None) -> list[dict[str, Any]]:
        """:meth:`handle` for sync code (the backend must run on the portal loop)."""
        return run_sync(self.handle(response, conversation_id), timeout)

    async def close(self, conversation_id: str) -> bool:
        """Release the conversation's slot (its workspace is emptied); whether it had one."""
        return await self.sessions.close(conversation_id)

    async def close_all(self) -> int:
        """Release every conversation's slot; return how many there were."""
        return await self.sessions.close_all()


def _check(call: _Call) -> tuple[dict[str, Any] | None, str | None]:
    """``(engine args, None)`` for a call that can run, else ``(None, message for the model)``."""
    spec = TOOL_SPECS.get(call.name)
    if call.kind != "function":
        return None, (f"Error: {call.kind} tool calls are not supported; call one of the functions "
                      f"{', '.join(TOOL_SPECS)} with JSON arguments. Nothing was run.")
    if spec is None:
        return None, (f"Error: unknown function {call.name!r}; the available functions are "
                      f"{', '.join(TOOL_SPECS)}. Nothing was run.")
    raw = call.arguments
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        raw = "{}"
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            return None, (f"Error: the arguments of {call.name} are not valid JSON ({exc}); send one "
                          f"JSON object. Nothing was run. Arguments received: {call.arguments[:200]!r}")
    if not isinstance(raw, Mapping):
        return None, (f"Error: the arguments of {call.name} must be a JSON object, got "
                      f"{type(raw).__name__}. Nothing was run.")
    try:
        return spec.engine_args(dict(raw)), None
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}"
                             for e in exc.errors())
        return None, f"Error: invalid arguments for {call.name}: {problems}. Nothing was run."


def format_result(tool: str, result: ExecutionResult) -> str:
    """A tool result as compact text for the model.

    ``bash``: the output, then a status line such as ``[exit code 0]``, ``[exit code
    2]`` or ``[exit code 124 (timed out): command timed out after 5s; ...]``. File
    tools: the output on success, ``Error: ...`` on failure.

    Example:
        >>> format_result("bash", ExecutionResult(True, "hi\\n", metadata={"returncode": 0}))
        'hi\\n[exit code 0]'
    """
    md = result.metadata
    rc = md.get("returncode")
    body = result.output
    if body and not body.endswith("\n"):
        body += "\n"
    if tool == "bash":
        if md.get("timed_out"):
            status = f"exit code {rc if rc is not None else 124} (timed out)"
        elif rc is not None:
            status = f"exit code {rc}"
        else:
            status = "error"
        if result.error and result.error != status:
            status += f": {result.error}"
        return f"{body}[{status}]"
    if result.success:
        if tool == "read_file":
            return read_file_text(result.output, md) or "(empty)"
        return result.output or "(empty)"
    return f"{body}Error: {result.error or f'exit code {rc}'}"


def _reply(api: Api, call_id: str, content: str) -> dict[str, Any]:
    if api == "chat":
        return {"role": "tool", "tool_call_id": call_id, "content": content}
    return {"type": "function_call_output", "call_id": call_id, "output": content}
