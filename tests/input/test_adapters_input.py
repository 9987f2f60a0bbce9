"""The three adapters given bad input.

- LangChain tools: bad arguments raise pydantic's ValidationError naming the field
  (what LangChain's ToolNode and agents expect and turn into a message for the model);
  a failure inside the sandbox is content, not an exception.
- OpenAI dispatcher: malformed JSON, unknown functions, bad argument types come back
  as a tool message naming the problem; the other calls of the turn run.
(Hermes: test_hermes_input.py.) In every case the conversation's shell state survives.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from input_support import portal_backend
from langchain_core.tools import ToolException
from pydantic import ValidationError

from hermes_modal_tool import ToolBackend, UsageError
from hermes_modal_tool.adapters.langchain import SandboxToolkit
from hermes_modal_tool.adapters.openai import ToolDispatcher
from hermes_modal_tool.portal import run_sync


@pytest.fixture(scope="module")
def backend() -> Iterator[ToolBackend]:
    with portal_backend(slots_per_sandbox=4, max_sandboxes=1) as b:
        yield b


# -- LangChain ------------------------------------------------------------------------------

LC_BAD: list[tuple[str, dict[str, Any], str]] = [
    ("bash", {}, "command"),
    ("bash", {"command": 5}, "command"),
    ("bash", {"command": None}, "command"),
    ("bash", {"command": ["ls"]}, "command"),
    ("bash", {"command": "true", "timeout": -1}, "timeout"),
    ("bash", {"command": "true", "timeout": 0}, "timeout"),
    ("bash", {"command": "true", "timeout": math.nan}, "timeout"),
    ("bash", {"command": "true", "timeout": math.inf}, "timeout"),
    ("bash", {"command": "true", "timeout": 10**400}, "timeout"),
    ("bash", {"command": "true", "timeout": "soon"}, "timeout"),
    ("bash", {"command": "true", "background": "maybe"}, "background"),
    ("bash", {"command": "true", "stdin": 5}, "stdin"),
    ("bash", {"command": "true", "bogus": 1}, "bogus"),
    ("bash", {"command": "true", "env": {"A": "1"}}, "env"),
    ("read_file", {}, "path"),
    ("read_file", {"path": 5}, "path"),
    ("read_file", {"path": "x", "offset": -1}, "offset"),
    ("read_file", {"path": "x", "limit": 0}, "limit"),
    ("read_file", {"path": "x", "limit": 1.5}, "limit"),
    ("read_file", {"path": "x", "encoding": "utf8"}, "encoding"),
    ("write_file", {"path": "x"}, "content"),
    ("write_file", {"path": "x", "content": 5}, "content"),
    ("write_file", {"path": "x", "content": "y", "append": "sometimes"}, "append"),
    ("write_file", {"path": "x", "content": "y", "encoding": 1}, "encoding"),
]


@pytest.fixture(scope="module")
def lc_tools(backend: ToolBackend) -> Iterator[dict[str, Any]]:
    toolkit = SandboxToolkit(backend)
    tools = {t.name: t for t in toolkit.get_tools()}
    yield tools
    toolkit.close()


def thread(tid: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": tid}}


@pytest.mark.parametrize(("tool", "args", "field"), LC_BAD, ids=[f"{t}-{f}-{a!r:.25}" for t, a, f in LC_BAD])
def test_langchain_bad_args_raise_validation_error_naming_the_field(lc_tools: dict[str, Any], tool: str,
                                                                    args: dict[str, Any], field: str) -> None:
    t = lc_tools[tool]
    with pytest.raises((ValidationError, ToolException)) as info:
        t.invoke(args, thread("lc-bad"))
    assert field in str(info.value), str(info.value)
    call = {"type": "tool_call", "id": "c1", "name": tool, "args": args}
    with pytest.raises((ValidationError, ToolException)):
        t.invoke(call, thread("lc-bad"))


def test_langchain_bad_calls_keep_the_threads_shell(lc_tools: dict[str, Any]) -> None:
    bash = lc_tools["bash"]
    cfg = thread("lc-state")
    out = bash.invoke({"command": "mkdir -p w && cd w && export LC_KEEP=yes"}, cfg)
    assert "[exit code 0]" in out, out
    for _tool, args, _field in LC_BAD:
        with pytest.raises((ValidationError, ToolException)):
            lc_tools[_tool].invoke(args, cfg)
    # failures inside the sandbox are content, not exceptions
    assert "Error" in lc_tools["read_file"].invoke({"path": "/no/such/file"}, cfg)
    assert "NUL" in lc_tools["write_file"].invoke({"path": "a\x00b", "content": "x"}, cfg)
    out = bash.invoke({"command": 'echo "$PWD $LC_KEEP"'}, cfg)
    assert out.startswith("/data/") and out.split("\n")[0].endswith("/w yes"), out


def test_langchain_tool_construction_errors_are_clear(backend: ToolBackend) -> None:
    from hermes_modal_tool.adapters.langchain import BashTool

    with pytest.raises(ValidationError, match="backend= or sessions="):
        BashTool()
    with pytest.raises(ValidationError, match="timeout_s"):
        BashTool(backend=backend, timeout_s=-1)
    with pytest.raises((ValidationError, ValueError), match="nope"):
        SandboxToolkit(backend, tools=["bash", "nope"])


# -- OpenAI -----------------------------------------------------------------------------------

def chat_turn(*calls: tuple[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in enumerate(calls)]}


OPENAI_BAD: list[tuple[str, Any, list[str]]] = [
    ("bash", '{"command": "ls"', ["not valid JSON", "bash"]),
    ("bash", "{command: ls}", ["not valid JSON"]),
    ("bash", "[1, 2]", ["JSON object", "list"]),
    ("bash", '"ls"', ["JSON object", "str"]),
    ("bash", "null", ["JSON object"]),
    ("bash", '{"command": 5}', ["command"]),
    ("bash", '{"command": "ls", "timeout": -3}', ["timeout"]),
    ("bash", '{"command": "ls", "timeout": "forever"}', ["timeout"]),
    ("bash", '{"command": "ls", "timeout": 1e999}', ["timeout"]),
    ("bash", '{"command": "ls", "timeout": NaN}', ["timeout"]),
    ("bash", '{"command": "ls", "timeout": 1' + "0" * 400 + "}", ["timeout"]),
    ("bash", '{"command": "ls", "background": "later"}', ["background"]),
    ("bash", '{"command": "ls", "rm": true}', ["rm"]),
    ("bash", '{"command": "a\\u0000b"}', ["NUL"]),
    ("read_file", '{"path": ["a"]}', ["path"]),
    ("read_file", '{"path": "a", "offset": -1}', ["offset"]),
    ("read_file", '{"path": "a\\u0000b"}', ["NUL"]),
    ("write_file", '{"path": "x"}', ["content"]),
    ("write_file", '{"path": "x", "content": "!!", "encoding": "base64"}', ["base64"]),
    ("shell", '{"command": "ls"}', ["unknown function", "'shell'", "bash"]),
    ("", "{}", ["unknown function"]),
    ("bash", {"command": 5}, ["command"]),
]


def test_openai_bad_calls_come_back_as_tool_messages_naming_the_problem(backend: ToolBackend) -> None:
    d = ToolDispatcher(backend)
    try:
        first = run_sync(d.handle(chat_turn(("bash", '{"command": "mkdir -p o && cd o && export OA=1"}')), "oa"))
        assert "[exit code 0]" in first[0]["content"], first
        calls = [("bash", '{"command": "echo before"}')] + [(n, a) for n, a, _ in OPENAI_BAD] + [
            ("bash", '{"command": "echo \\"$PWD $OA\\""}')]
        try:
            out = run_sync(d.handle(chat_turn(*calls), "oa"))
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"dispatcher raised {type(exc).__name__}: {exc}")
        assert len(out) == len(calls)
        assert [m["tool_call_id"] for m in out] == [f"call_{i}" for i in range(len(calls))]
        assert out[0]["content"].startswith("before\n")
        problems = []
        for (name, args, words), msg in zip(OPENAI_BAD, out[1:-1], strict=True):
            content = msg["content"]
            if "[exit code 0]" in content:
                problems.append(f"{name} {args!r:.60}: not refused: {content[:120]!r}")
                continue
            missing = [w for w in words if w not in content]
            if missing:
                problems.append(f"{name} {args!r:.60}: {missing} not in {content[:200]!r}")
        assert out[-1]["content"].split("\n")[0].endswith("/o 1"), out[-1]
        assert not problems, "\n".join(problems)
    finally:
        run_sync(d.close_all())


@pytest.mark.parametrize("response", [None, 5, "bash ls", b"x", {"foo": 1}, [1, 2], object()])
def test_openai_unrecognised_response_is_a_usage_error(backend: ToolBackend, response: Any) -> None:
    d = ToolDispatcher(backend)
    with pytest.raises(UsageError, match="expected a ChatCompletion"):
        run_sync(d.handle(response, "conv"))


@pytest.mark.parametrize("conversation_id", ["", None, 5, ["c"]])
def test_openai_bad_conversation_id_is_named(backend: ToolBackend, conversation_id: Any) -> None:
    d = ToolDispatcher(backend)
    with pytest.raises(UsageError, match="conversation_id") as info:
        run_sync(d.handle(chat_turn(("bash", '{"command": "true"}')), conversation_id))
    assert repr(conversation_id) in str(info.value)


def test_openai_tool_calls_of_odd_shapes_do_not_crash(backend: ToolBackend) -> None:
    d = ToolDispatcher(backend)
    odd = [
        {"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "bash"}}]},
        {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                              "function": {"name": None, "arguments": "{}"}}]},
        {"role": "assistant", "tool_calls": [{"id": None, "type": "function",
                                              "function": {"name": "bash", "arguments": 5}}]},
        {"role": "assistant", "tool_calls": ["bash"]},
        {"role": "assistant", "tool_calls": [None]},
        {"role": "assistant", "tool_calls": {"id": "a"}},
        {"type": "function_call", "call_id": "x", "name": "bash", "arguments": "{"},
        {"output": [{"type": "function_call", "call_id": "x", "name": "nope", "arguments": "{}"}]},
    ]
    problems = []
    try:
        for response in odd:
            try:
                out = run_sync(d.handle(response, "odd"))
            except UsageError:
                continue
            except Exception as exc:  # noqa: BLE001
                problems.append(f"{response!r:.100}: {type(exc).__name__}: {exc}")
                continue
            for m in out:
                text = m.get("content", m.get("output"))
                assert isinstance(text, str) and text, m
    finally:
        run_sync(d.close_all())
    assert not problems, "\n".join(problems)


