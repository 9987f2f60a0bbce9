"""A scripted stand-in for the OpenAI API on 127.0.0.1: Chat Completions and Responses.

The "model" follows a script, a list of turns: :class:`ToolTurn` (function calls,
several in one turn = parallel calls) or :class:`TextTurn` (the final answer).
Which turn a request is at is read from the request (the last scripted call its
history holds), so one server serves many conversations at once. Answers are
realistic JSON (ids, ``created``, ``usage``, ...) that the ``openai`` SDK parses
into its own types. Every request is checked the way the API checks it:

- each tool definition is a function tool of the right shape for its API and obeys
  strict mode: ``strict: true``, ``additionalProperties: false`` and every property
  in ``required`` on every object, only keywords strict mode supports, a valid name;
- every function call in the history has exactly one tool result that references
  its call id, and no result references a call that is not in the history.

A request that fails a check is answered with HTTP 400 in the API's error shape
(the SDK raises ``openai.BadRequestError``) and the problem is recorded in
:attr:`FakeOpenAIServer.errors`. Stdlib only; listens on 127.0.0.1 only.

Example:
    >>> from openai import OpenAI
    >>> script = [ToolTurn([("bash", {"command": "pwd"})]), TextTurn("You are in {last_output}")]
    >>> with FakeOpenAIServer(script) as server:                    # doctest: +SKIP
    ...     client = OpenAI(base_url=server.base_url, api_key="test", max_retries=0)
    ...     completion = client.chat.completions.create(model="fake", messages=[...], tools=...)
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["FakeOpenAIServer", "TextTurn", "ToolTurn", "strict_schema_problems",
           "tool_definition_problems"]

NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
#: JSON-schema keywords strict mode accepts (anything else is rejected, e.g. ``default``).
STRICT_KEYWORDS = frozenset({
    "type", "description", "title", "properties", "required", "additionalProperties", "items",
    "enum", "const", "anyOf", "$defs", "definitions", "$ref", "pattern", "format", "minimum",
    "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems", "maxItems"})
JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
MAX_DEPTH = 10


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


# -- strict-mode checks ---------------------------------------------------------------

def tool_definition_problems(tool: Any, api: str, require_strict: bool = True) -> list[str]:
    """What is wrong with one tool definition for ``api`` (``"chat"`` or ``"responses"``).

    A Responses API ``custom`` (free-form) tool, such as the Agents SDK's
    ``apply_patch``, is accepted when it has a valid name and description; the
    script never calls it.
    """
    if api == "responses" and isinstance(tool, Mapping) and tool.get("type") == "custom":
        name = tool.get("name")
        problems = [f"custom tool {name}: unexpected key {k!r}"
                    for k in sorted(set(tool) - {"type", "name", "description", "format"})]
        if not isinstance(name, str) or not NAME_RE.match(name):
            problems.append(f"invalid custom tool name {name!r}: must match {NAME_RE.pattern}")
        if not isinstance(tool.get("description", ""), str):
            problems.append(f"custom tool {name}: description must be a string")
        return problems
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        return [f"tool {tool!r:.80}: only function tools are scripted here ('type': 'function')"]
    if api == "chat":
        extra = set(tool) - {"type", "function"}
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            return ["chat tools need a 'function' object: {'type': 'function', 'function': {...}}"]
        allowed = {"name", "description", "parameters", "strict"}
    else:
        fn, extra = tool, set()
        if "function" in tool:
            return ["Responses API tools are flat ({'type': 'function', 'name': ...}); "
                    "found a Chat Completions 'function' wrapper"]
        allowed = {"type", "name", "description", "parameters", "strict"}
    name = fn.get("name")
    problems = [f"tool {name}: unexpected key {k!r}" for k in sorted(extra | (set(fn) - allowed))]
    if not isinstance(name, str) or not NAME_RE.match(name):
        problems.append(f"invalid function name {name!r}: must match {NAME_RE.pattern}")
    if not isinstance(fn.get("description", ""), str):
        problems.append(f"tool {name}: description must be a string")
    if require_strict and fn.get("strict") is not True:
        problems.append(f"tool {name}: 'strict' must be true, got {fn.get('strict')!r}")
    if fn.get("strict") is True:
        problems += strict_schema_problems(fn.get("parameters"), f"{name}.parameters")
    return problems


def strict_schema_problems(schema: Any, where: str = "parameters") -> list[str]:
    """What in a function's ``parameters`` breaks OpenAI's strict-mode rules."""
    if not isinstance(schema, Mapping):
        return [f"{where}: must be a JSON schema object"]
    problems = []
    if schema.get("type") != "object" or "anyOf" in schema:
        problems.append(f"{where}: the root must be an object schema (type 'object', not anyOf)")
    _walk(schema, where, 0, problems)
    return problems


def _types(node: Mapping[str, Any]) -> list[str]:
    t = node.get("type")
    return [t] if isinstance(t, str) else list(t) if isinstance(t, list) else []


def _json_type(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"object"} if isinstance(value, dict) else {"array"}


def _walk(node: Any, path: str, depth: int, problems: list[str]) -> None:
    if depth > MAX_DEPTH:
        problems.append(f"{path}: nested deeper than {MAX_DEPTH} levels")
        return
    if not isinstance(node, Mapping):
        problems.append(f"{path}: a schema must be an object, got {node!r:.60}")
        return
    problems += [f"{path}: '{k}' is not permitted in strict mode" for k in node if k not in STRICT_KEYWORDS]
    types = _types(node)
    if "type" in node and (not types or any(t not in JSON_TYPES for t in types)):
        problems.append(f"{path}: invalid type {node['type']!r}")
    if "type" not in node and not any(k in node for k in ("anyOf", "$ref", "enum", "const")):
        problems.append(f"{path}: every schema needs a 'type' (or anyOf/$ref/enum/const)")
    if "enum" in node:
        values = node["enum"]
        if not isinstance(values, list) or not values:
            problems.append(f"{path}: enum must be a non-empty list")
        elif types:
            problems += [f"{path}: enum value {v!r} is not of type {types}"
                         for v in values if not _json_type(v) & set(types)]
    if "object" in types or "properties" in node:
        props = node.get("properties", {})
        if node.get("additionalProperties") is not False:
            problems.append(f"{path}: 'additionalProperties' must be false")
        required = node.get("required")
        if not isinstance(required, list) or set(required) != set(props) or len(set(required)) != len(required):
            missing = sorted(set(props) - set(required or []))
            problems.append(f"{path}: 'required' must list every property exactly once (missing: {missing})")
        for key, sub in (props.items() if isinstance(props, Mapping) else []):
            _walk(sub, f"{path}.{key}", depth + 1, problems)
    if "items" in node:
        _walk(node["items"], f"{path}[]", depth + 1, problems)
    if "anyOf" in node:
        variants = node["anyOf"]
        if not isinstance(variants, list) or not variants:
            problems.append(f"{path}: anyOf must be a non-empty list")
        else:
            for i, sub in enumerate(variants):
                _walk(sub, f"{path}.anyOf[{i}]", depth, problems)
    for defs_key in ("$defs", "definitions"):
        for key, sub in (node.get(defs_key) or {}).items():
            _walk(sub, f"{path}.{defs_key}.{key}", depth + 1, problems)


# -- the server ---------------------------------------------------------------------

class _BadRequest(Exception):
    def __init__(self, problems: list[str], param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__("; ".join(problems))
        self.problems, self.param, self.status, self.code = problems, param, status, code


class FakeOpenAIServer:
    """A scripted OpenAI API (``/v1/chat/completions``, ``/v1/responses``) on 127.0.0.1.

    Args:
        script: the turns every conversation goes through, or ``{model name: turns}``
            to pick a script by the request's ``model``.
        require_strict: reject requests whose tools are not ``strict: true``.
        port: 0 picks a free port.

    Attributes:
        base_url: ``http://127.0.0.1:PORT/v1`` for ``OpenAI(base_url=...)``.
        requests: every request as ``{"path", "body"}``.
        responses: every answer as ``{"path", "status", "body"}``.
        errors: every problem found in a request (each was answered with an error).
    """

    def __init__(self, script: Script | Mapping[str, Script], *, require_strict: bool = True,
                 port: int = 0) -> None:
        self.script = script
        self.require_strict = require_strict
        self.requests: list[dict[str, Any]] = []
        self.responses: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._port = port
        self._lock = threading.Lock()
        self._calls: dict[str, dict[str, Any]] = {}  # call id -> {"turn", "name", "arguments"}
        self._stored: dict[str, list[dict[str, Any]]] = {}  # response id -> items up to its output
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------
    def start(self) -> FakeOpenAIServer:
        """Listen on 127.0.0.1 in a background thread."""
        if self._httpd is not None:
            return self
        httpd = ThreadingHTTPServer(("127.0.0.1", self._port), _Handler)
        httpd.fake = self  # type: ignore[attr-defined]
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, name="fake-openai", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening (idempotent)."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("the server is not started")
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def check(self) -> None:
        """Raise AssertionError listing every problem found in the requests so far."""
        if self.errors:
            raise AssertionError("the fake OpenAI server rejected requests:\n" + "\n".join(self.errors))

    # -- requests -------------------------------------------------------------------
    def handle(self, path: str, headers: Mapping[str, str], raw: bytes) -> tuple[int, dict[str, Any]]:
        """Answer one POST: ``(HTTP status, JSON body)``."""
        with self._lock:
            body: Any = None
            try:
                if not str(headers.get("Authorization", "")).startswith("Bearer "):
                    raise _BadRequest(["You didn't provide an API key."], status=401, code="invalid_api_key")
                try:
                    body = json.loads(raw or b"null")
                except ValueError as exc:
                    raise _BadRequest([f"We could not parse the JSON body of your request ({exc})."]) from None
                if not isinstance(body, dict):
                    raise _BadRequest(["The request body must be a JSON object."])
                if body.get("stream"):
                    raise _BadRequest(["streaming is not scripted by this fake server"], "stream")
                if path.rstrip("/") == "/v1/chat/completions":
                    status, answer = 200, self._chat(body)
                elif path.rstrip("/") == "/v1/responses":
                    status, answer = 200, self._responses(body)
                else:
                    raise _BadRequest([f"Unknown request URL: POST {path}."], status=404, code="unknown_url")
            except _BadRequest as exc:
                self.errors.append(f"POST {path}: " + "; ".join(exc.problems))
                status, answer = exc.status, {"error": {
                    "message": "; ".join(exc.problems), "type": "invalid_request_error",
                    "param": exc.param, "code": exc.code}}
            self.requests.append({"path": path, "body": body})
            self.responses.append({"path": path, "status": status, "body": answer})
            return status, answer

    def _script_for(self, model: Any) -> Script:
        if isinstance(self.script, Mapping):
            if model not in self.script:
                raise _BadRequest([f"The model `{model}` does not exist or you do not have access to it."],
                                  "model", 404, "model_not_found")
            return self.script[model]
        return self.script

    def _check_tools(self, tools: Any, api: str) -> None:
        if tools is None:
            if self.require_strict:
                raise _BadRequest(["no tools in the request"], "tools")
            return
        if not isinstance(tools, list):
            raise _BadRequest(["'tools' must be a list"], "tools")
        problems = [p for t in tools for p in tool_definition_problems(t, api, self.require_strict)]
        if problems:
            raise _BadRequest(problems, "tools", code="invalid_function_parameters")

    def _next_turn(self, model: Any, call_ids: list[str]) -> tuple[int, ToolTurn | TextTurn]:
        script = self._script_for(model)
        turn = 1 + max((self._calls[c]["turn"] for c in call_ids if c in self._calls), default=-1)
        if turn >= len(script):
            raise _BadRequest([f"the script of model {model!r} has no turn {turn}"], "messages")
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
            raise _BadRequest(["'messages' must be a non-empty list of objects"], "messages")
        problems = self._chat_result_problems(messages)
        if problems:
            raise _BadRequest(problems, "messages")
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
            raise _BadRequest(["'input' must be a string or a list of items"], "input")
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self._stored:
            raise _BadRequest([f"Previous response with id '{previous}' not found."],
                              "previous_response_id", code="previous_response_not_found")
        context = (self._stored[previous] if previous else []) + items
        problems = self._responses_result_problems(context)
        if problems:
            raise _BadRequest(problems, "input")
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


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-openai/1.0"
    timeout = 30  # seconds an idle keep-alive connection is kept

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status, answer = self.server.fake.handle(self.path, self.headers, raw)  # type: ignore[attr-defined]
        self._send(status, answer)

    def do_GET(self) -> None:  # noqa: N802
        self._send(404, {"error": {"message": f"Unknown request URL: GET {self.path}.",
                                   "type": "invalid_request_error", "param": None, "code": "unknown_url"}})

    def _send(self, status: int, answer: dict[str, Any]) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-request-id", "req_" + uuid.uuid4().hex)
        self.send_header("openai-processing-ms", "1")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass
