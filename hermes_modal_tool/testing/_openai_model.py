"""The scripted "model" behind the fake OpenAI server: its turns and its two APIs.

Holds the script types (:class:`ToolTurn`, :class:`TextTurn`, ``Script``) and
:class:`ScriptedModel`, which answers one parsed Chat Completions or Responses
request body: it checks the tools and the tool results in the history, picks the
script's next turn and builds the answer the real API would send.
:class:`~hermes_modal_tool.testing.openai_server.FakeOpenAIServer` (the HTTP side,
which re-exports the script types) is a ``ScriptedModel``; nothing else uses this
module. Stdlib only.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._openai_strict import tool_definition_problems

__all__ = ["BadRequest", "Script", "ScriptedModel", "TextTurn", "ToolTurn"]


@dataclass(frozen=True)
class ToolTurn:
    """The model calls these functions in one turn, in this order.

    Each call is ``(name, arguments)``: a mapping is sent as JSON, a string as it is
    (to send malformed JSON on purpose), a callable is given the tool results just sent
    (a list of str) and returns the mapping (a model reading an id from a result).
    """

    calls: Sequence[tuple[str, Mapping[str, Any] | str | Callable[[list[str]], Mapping[str, Any]]]]


@dataclass(frozen=True)
class TextTurn:
    """The model answers with text; ``{last_output}`` becomes the tool results it was
    just sent, joined by newlines."""

    text: str


Script = Sequence[ToolTurn | TextTurn]


class BadRequest(Exception):
    """Raised when a request fails a check; answered with ``status`` in the API's error shape."""

    def __init__(self, problems: list[str], param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__("; ".join(problems))
        self.problems, self.param, self.status, self.code = problems, param, status, code


class ScriptedModel:
    """Answers request bodies by following a script (the logic of ``FakeOpenAIServer``).

    Which turn a request is at is read from the call ids in its history, so one
    model serves many conversations at once. Not thread-safe: the server calls it
    under its lock.
    """

    def __init__(self, script: Script | Mapping[str, Script], *, require_strict: bool = True) -> None:
        self.script = script
        self.require_strict = require_strict
        self._calls: dict[str, dict[str, Any]] = {}  # call id -> {"turn", "name", "arguments"}
        self._stored: dict[str, list[dict[str, Any]]] = {}  # response id -> items up to its output

    # -- turns ------------------------------------------------------------------------
    def _script_for(self, model: Any) -> Script:
        if isinstance(self.script, Mapping):
            if model not in self.script:
                raise BadRequest([f"The model `{model}` does not exist or you do not have access to it."],
                                 "model", 404, "model_not_found")
            return self.script[model]
        return self.script

    def _check_tools(self, tools: Any, api: str) -> None:
        if tools is None:
            if self.require_strict:
                raise BadRequest(["no tools in the request"], "tools")
            return
        if not isinstance(tools, list):
            raise BadRequest(["'tools' must be a list"], "tools")
        problems = [p for t in tools for p in tool_definition_problems(t, api, self.require_strict)]
        if problems:
            raise BadRequest(problems, "tools", code="invalid_function_parameters")

    def _next_turn(self, model: Any, call_ids: list[str]) -> tuple[int, ToolTurn | TextTurn]:
        script = self._script_for(model)
        turn = 1 + max((self._calls[c]["turn"] for c in call_ids if c in self._calls), default=-1)
        if turn >= len(script):
            raise BadRequest([f"the script of model {model!r} has no turn {turn}"], "messages")
        return turn, script[turn]

    def _new_calls(self, turn: int, step: ToolTurn, results: list[str]) -> list[dict[str, Any]]:
        out = []
        for name, args in step.calls:
            call_id = "call_" + uuid.uuid4().hex[:24]
            args = args(results) if callable(args) else args
            arguments = args if isinstance(args, str) else json.dumps(dict(args))
            self._calls[call_id] = {"turn": turn, "name": name, "arguments": arguments}
            out.append({"call_id": call_id, "name": name, "arguments": arguments})
        return out

    # -- Chat Completions ----------------------------------------------------------
    def _chat(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check_tools(body.get("tools"), "chat")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest(["'messages' must be a non-empty list of objects"], "messages")
        problems = self._chat_result_problems(messages)
        if problems:
            raise BadRequest(problems, "messages")
        ids = [tc.get("id") for m in messages if m.get("role") == "assistant"
               for tc in (m.get("tool_calls") or [])]
        turn, step = self._next_turn(body.get("model"), ids)
        tail = []
        for m in reversed(messages):
            if m.get("role") != "tool":
                break
            tail.insert(0, _text(m.get("content")))
        message: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None, "annotations": []}
        if isinstance(step, ToolTurn):
            message["tool_calls"] = [
                {"id": c["call_id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in self._new_calls(turn, step, tail)]
            finish = "tool_calls"
        else:
            message["content"] = step.text.replace("{last_output}", "\n".join(tail))
            finish = "stop"
        prompt, completion = _tokens(messages) + _tokens(body.get("tools")), _tokens(message)
        return {
            "id": "chatcmpl-" + uuid.uuid4().hex[:29], "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model"),
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                      "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                                    "accepted_prediction_tokens": 0,
                                                    "rejected_prediction_tokens": 0}},
            "service_tier": "default", "system_fingerprint": "fp_fake0001",
        }

    def _chat_result_problems(self, messages: list[dict[str, Any]]) -> list[str]:
        problems: list[str] = []
        pending: dict[str, int] | None = None  # call id -> results seen, for the last tool-calling turn

        def close_turn(where: str) -> None:
            missing = [c for c, n in (pending or {}).items() if n == 0]
            if missing:
                problems.append(f"{where}: an assistant message with 'tool_calls' must be followed by tool "
                                f"messages responding to each 'tool_call_id'; missing: {missing}")

        for i, m in enumerate(messages):
            role = m.get("role")
            if role == "tool":
                cid = m.get("tool_call_id")
                if pending is None or cid not in pending:
                    problems.append(f"messages[{i}]: tool message with tool_call_id {cid!r} does not answer "
                                    "a call of the preceding assistant message")
                else:
                    pending[cid] += 1
                    if pending[cid] > 1:
                        problems.append(f"messages[{i}]: second tool message for {cid!r}")
                if not isinstance(m.get("content"), (str, list)):
                    problems.append(f"messages[{i}]: tool message content must be a string")
                continue
            close_turn(f"messages[{i}]")
            pending = None
            if role == "assistant" and m.get("tool_calls"):
                pending = {}
                for tc in m["tool_calls"]:
                    cid = tc.get("id")
                    if cid not in self._calls:
                        problems.append(f"messages[{i}]: tool call id {cid!r} was not issued by this server")
                    pending[cid] = 0
        close_turn("end of messages")
        return problems

    # -- Responses -------------------------------------------------------------------
    def _responses(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check_tools(body.get("tools"), "responses")
        raw_input = body.get("input")
        if isinstance(raw_input, str):
            items = [{"type": "message", "role": "user", "content": raw_input}]
        elif isinstance(raw_input, list) and all(isinstance(x, dict) for x in raw_input):
            items = list(raw_input)
        else:
            raise BadRequest(["'input' must be a string or a list of items"], "input")
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self._stored:
            raise BadRequest([f"Previous response with id '{previous}' not found."],
                             "previous_response_id", code="previous_response_not_found")
        context = (self._stored[previous] if previous else []) + items
        problems = self._responses_result_problems(context)
        if problems:
            raise BadRequest(problems, "input")
        ids = [x.get("call_id") for x in context if x.get("type") == "function_call"]
        turn, step = self._next_turn(body.get("model"), ids)
        tail = []
        for x in reversed(items):
            if x.get("type") != "function_call_output":
                break
            tail.insert(0, _text(x.get("output")))
        if isinstance(step, ToolTurn):
            output = [{"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": c["call_id"],
                       "name": c["name"], "arguments": c["arguments"], "status": "completed"}
                      for c in self._new_calls(turn, step, tail)]
        else:
            text = step.text.replace("{last_output}", "\n".join(tail))
            output = [{"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": "completed",
                       "role": "assistant",
                       "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}]
        response_id = "resp_" + uuid.uuid4().hex
        self._stored[response_id] = context + output
        prompt, completion = _tokens(context) + _tokens(body.get("tools")), _tokens(output)
        now = int(time.time())
        return {
            "id": response_id, "object": "response", "created_at": now, "completed_at": now,
            "status": "completed", "background": False, "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "max_tool_calls": None, "model": body.get("model"), "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": previous, "reasoning": {"effort": None, "summary": None},
            "service_tier": "default", "store": body.get("store", True), "temperature": 1.0,
            "text": {"format": {"type": "text"}, "verbosity": "medium"},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "top_logprobs": 0, "top_p": 1.0, "truncation": "disabled",
            "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt + completion},
            "user": None, "metadata": body.get("metadata") or {},
        }

    def _responses_result_problems(self, context: list[dict[str, Any]]) -> list[str]:
        problems: list[str] = []
        answered: dict[str, int] = {}
        for i, item in enumerate(context):
            kind = item.get("type")
            cid = item.get("call_id")
            if kind == "function_call":
                if cid not in self._calls:
                    problems.append(f"input[{i}]: function call {cid!r} was not issued by this server")
                answered.setdefault(cid, 0)
            elif kind == "function_call_output":
                if cid not in answered:
                    problems.append(f"No tool call found for function call output with call_id {cid}.")
                    continue
                answered[cid] += 1
                if answered[cid] > 1:
                    problems.append(f"input[{i}]: second function_call_output for call_id {cid}")
                if not isinstance(item.get("output"), (str, list)):
                    problems.append(f"input[{i}]: function_call_output.output must be a string")
        problems += [f"No tool output found for function call {cid}." for cid, n in answered.items() if n == 0]
        return problems


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _tokens(value: Any) -> int:
    return max(1, len(json.dumps(value, default=str)) // 4) if value else 0
