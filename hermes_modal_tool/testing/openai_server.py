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
:attr:`FakeOpenAIServer.errors`. Stdlib only. A test tool, not for production: it
listens on 127.0.0.1 only and checks no API key (any local user may call it).

Example:
    >>> from openai import OpenAI
    >>> script = [ToolTurn([("bash", {"command": "pwd"})]), TextTurn("You are in {last_output}")]
    >>> with FakeOpenAIServer(script) as server:                    # doctest: +SKIP
    ...     client = OpenAI(base_url=server.base_url, api_key="test", max_retries=0)
    ...     completion = client.chat.completions.create(model="fake", messages=[...], tools=...)
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# The script types and the strict-mode checks live in private modules; this is their
# public home, so ``from hermes_modal_tool.testing.openai_server import ...`` keeps working.
from ._openai_model import BadRequest, Script, ScriptedModel, TextTurn, ToolTurn
from ._openai_strict import (  # noqa: F401 (constants kept importable from here)
    JSON_TYPES,
    MAX_DEPTH,
    NAME_RE,
    STRICT_KEYWORDS,
    strict_schema_problems,
    tool_definition_problems,
)

__all__ = ["FakeOpenAIServer", "TextTurn", "ToolTurn", "strict_schema_problems",
           "tool_definition_problems"]


class FakeOpenAIServer(ScriptedModel):
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

    The answers themselves come from
    :class:`~hermes_modal_tool.testing._openai_model.ScriptedModel`; this class adds
    the HTTP side: listening, authentication, JSON bodies and the request log.
    """

    def __init__(self, script: Script | Mapping[str, Script], *, require_strict: bool = True,
                 port: int = 0) -> None:
        super().__init__(script, require_strict=require_strict)
        self.requests: list[dict[str, Any]] = []
        self.responses: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._port = port
        self._lock = threading.Lock()
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
                    raise BadRequest(["You didn't provide an API key."], status=401, code="invalid_api_key")
                try:
                    body = json.loads(raw or b"null")
                except ValueError as exc:
                    raise BadRequest([f"We could not parse the JSON body of your request ({exc})."]) from None
                if not isinstance(body, dict):
                    raise BadRequest(["The request body must be a JSON object."])
                if body.get("stream"):
                    raise BadRequest(["streaming is not scripted by this fake server"], "stream")
                if path.rstrip("/") == "/v1/chat/completions":
                    status, answer = 200, self._chat(body)
                elif path.rstrip("/") == "/v1/responses":
                    status, answer = 200, self._responses(body)
                else:
                    raise BadRequest([f"Unknown request URL: POST {path}."], status=404, code="unknown_url")
            except BadRequest as exc:
                self.errors.append(f"POST {path}: " + "; ".join(exc.problems))
                status, answer = exc.status, {"error": {
                    "message": "; ".join(exc.problems), "type": "invalid_request_error",
                    "param": exc.param, "code": exc.code}}
            self.requests.append({"path": path, "body": body})
            self.responses.append({"path": path, "status": status, "body": answer})
            return status, answer


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
