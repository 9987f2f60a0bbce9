"""The OpenAI adapter with the real ``openai`` client against a scripted API on 127.0.0.1.

The server (:mod:`hermes_modal_tool.testing.openai_server`) speaks the Chat
Completions and Responses wire formats, answers with scripted tool calls, and
rejects (HTTP 400, recorded in ``server.errors``) any request whose tools break
strict mode or whose tool results do not answer the calls by id.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from openai.types.chat import ChatCompletion, ChatCompletionFunctionToolParam
from openai.types.responses import FunctionToolParam, Response
from pydantic import TypeAdapter

from hermes_modal_tool import SandboxConfig, ToolBackend, UsageError
from hermes_modal_tool.adapters.openai import ToolDispatcher, format_result, openai_tools
from hermes_modal_tool.portal import run_sync
from hermes_modal_tool.slots import ExecutionResult
from hermes_modal_tool.testing.openai_server import (
    FakeOpenAIServer,
    TextTurn,
    ToolTurn,
    strict_schema_problems,
    tool_definition_problems,
)
from hermes_modal_tool.tools import TOOL_SPECS

PROMPT = "Make a directory proj, go into it, and save a note there."
SCRIPTS = {
    "loop": [
        ToolTurn([("bash", {"command": "mkdir proj && cd proj"})]),
        ToolTurn([("bash", {"command": "pwd"})]),
        ToolTurn([("write_file", {"path": "proj/notes.txt", "content": "hello from the model\n"}),
                  ("bash", {"command": "cat notes.txt"})]),
        TextTurn("Done. The note says: {last_output}"),
    ],
    "mistakes": [
        ToolTurn([
            ("bash", {"command": "echo one > log.txt"}),
            ("bash", '{"command": "echo two >> log.txt"'),           # malformed JSON
            ("delete_everything", {"path": "/"}),                     # unknown function
            ("bash", {"cmd": "echo three >> log.txt"}),               # fails the schema
            ("read_file", {"path": "log.txt", "offset": -1}),         # fails the schema
            ("bash", {"command": "echo four >> log.txt; cat log.txt", "timeout": None,
                      "background": None, "stdin": None}),            # strict-mode nulls
        ]),
        TextTurn("{last_output}"),
    ],
    "parallel": [
        ToolTurn([*(("bash", {"command": f"echo {i} >> order.txt"}) for i in range(6)),
                  ("bash", {"command": "echo started; sleep 5", "timeout": 0.5}),
                  ("bash", {"command": "ls missing-file"}),
                  ("read_file", {"path": "order.txt"})]),
        TextTurn("ok"),
    ],
}


@pytest.fixture
def server():
    with FakeOpenAIServer(SCRIPTS) as fake:
        yield fake


async def started(make_backend: Any) -> ToolBackend:
    return await make_backend(slots_per_sandbox=4, min_sandboxes=1, max_sandboxes=2)


async def chat_loop(client: AsyncOpenAI, dispatcher: ToolDispatcher, conversation: str,
                    model: str = "loop") -> tuple[str, list[Any]]:
    """The usual Chat Completions loop; returns the final text and the transcript."""
    messages: list[Any] = [{"role": "user", "content": PROMPT}]
    for turn in range(8):
        completion = await client.chat.completions.create(model=model, messages=messages,
                                                          tools=openai_tools("chat"))
        message = completion.choices[0].message
        messages.append(message)
        # Alternate what is handed over: the ChatCompletion itself or its message.
        results = await dispatcher.handle(completion if turn % 2 else message, conversation)
        if not results:
            return message.content, messages
        messages.extend(results)
    raise AssertionError("the model never answered")


async def responses_loop(client: AsyncOpenAI, dispatcher: ToolDispatcher, conversation: str,
                         model: str = "loop", chain: bool = False) -> tuple[str, list[Any]]:
    """The Responses loop: resend the whole input, or chain with previous_response_id."""
    items: list[Any] = [{"role": "user", "content": PROMPT}]
    sent, extra = items, {}
    for _ in range(8):
        response = await client.responses.create(model=model, input=sent,
                                                 tools=openai_tools("responses"), **extra)
        results = await dispatcher.handle(response.output if chain else response, conversation)
        if not results:
            return response.output_text, items
        if chain:
            sent, extra = results, {"previous_response_id": response.id}
            items += [*response.output, *results]
        else:
            items += [*response.output, *results]
            sent = items
    raise AssertionError("the model never answered")


def tool_outputs(transcript: list[Any]) -> list[str]:
    return [m["content"] if m.get("role") == "tool" else m["output"]
            for m in transcript if isinstance(m, dict)
            and (m.get("role") == "tool" or m.get("type") == "function_call_output")]


def check_server(server: FakeOpenAIServer) -> None:
    """No request was rejected, and every answer parses strictly as the SDK's type."""
    server.check()
    for answer in server.responses:
        model = ChatCompletion if answer["path"].endswith("/chat/completions") else Response
        model.model_validate(answer["body"])


# -- tool definitions ---------------------------------------------------------------

@pytest.mark.parametrize("api", ["chat", "responses"])
def test_tool_definitions_derive_from_the_contract_and_obey_strict_mode(api: str) -> None:
    tools = openai_tools(api)
    shape = TypeAdapter(ChatCompletionFunctionToolParam if api == "chat" else FunctionToolParam)
    assert [(t["function"] if api == "chat" else t)["name"] for t in tools] == list(TOOL_SPECS)
    for tool, spec in zip(tools, TOOL_SPECS.values(), strict=True):
        shape.validate_python(tool)
        fn = tool["function"] if api == "chat" else tool
        assert fn["description"] == spec.description and fn["strict"] is True
        assert tool_definition_problems(tool, api) == []
        schema = fn["parameters"]
        jsonschema.Draft202012Validator.check_schema(schema)
        validator = jsonschema.Draft202012Validator(schema)
        # Optional arguments are a union with null: "all optional values null" is valid,
        # and is what the argument model reads as "not given".
        required = {n: f for n, f in spec.args_model.model_fields.items() if f.is_required()}
        nulls = {name: ("x" if name in required else None) for name in schema["properties"]}
        assert validator.is_valid(nulls), nulls
        assert spec.engine_args(nulls) == spec.engine_args({k: v for k, v in nulls.items() if v is not None})
        assert not validator.is_valid({**nulls, "surprise": 1})  # no extra properties
        for name in schema["properties"]:  # every property must be sent
            assert not validator.is_valid({k: v for k, v in nulls.items() if k != name})


def test_non_strict_definitions_and_the_servers_checker() -> None:
    loose = openai_tools("responses", strict=False)
    assert all(t["strict"] is False for t in loose)  # the Responses API defaults to strict
    assert loose[0]["parameters"] == TOOL_SPECS["bash"].json_schema()
    assert tool_definition_problems(loose[0], "responses") == ["tool bash: 'strict' must be true, got False"]
    assert tool_definition_problems(openai_tools("chat")[0], "responses")  # chat shape on responses
    bad = {"type": "object", "properties": {"a": {"type": "string", "default": "x"}, "b": {}},
           "required": ["a"]}
    problems = "\n".join(strict_schema_problems(bad))
    for expected in ("'default' is not permitted", "'additionalProperties' must be false",
                     "missing: ['b']", "needs a 'type'"):
        assert expected in problems
    with pytest.raises(UsageError):
        openai_tools("assistants")  # type: ignore[arg-type]


async def test_server_rejects_non_strict_tools_and_unanswered_calls(server: FakeOpenAIServer) -> None:
    async with AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError, match="'strict' must be true"):
            await client.chat.completions.create(model="loop", messages=[{"role": "user", "content": "hi"}],
                                                 tools=openai_tools("chat", strict=False))
        first = await client.responses.create(model="loop", input=PROMPT, tools=openai_tools("responses"))
        with pytest.raises(openai.BadRequestError, match="No tool output found for function call"):
            await client.responses.create(model="loop", input=[{"role": "user", "content": PROMPT},
                                                              *first.output],
                                          tools=openai_tools("responses"))
    assert len(server.errors) == 2


# -- whole loops with the real client -------------------------------------------------

async def test_chat_completions_loop(make_backend: Any, server: FakeOpenAIServer) -> None:
    dispatcher = ToolDispatcher(await started(make_backend))
    async with AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0) as client:
        answer, transcript = await chat_loop(client, dispatcher, "conv-chat")
    workspace = dispatcher.sessions.info()["conv-chat"]["workspace"]
    assert tool_outputs(transcript) == [
        "[exit code 0]",
        f"{workspace}/proj\n[exit code 0]",  # `cd proj` persisted to the next turn
        f"wrote 21 bytes to {workspace}/proj/notes.txt",
        "hello from the model\n[exit code 0]",
    ]
    assert answer == ("Done. The note says: wrote 21 bytes to " f"{workspace}/proj/notes.txt\n"
                      "hello from the model\n[exit code 0]")
    assert len(server.requests) == 4
    check_server(server)
    assert await dispatcher.close_all() == 1


@pytest.mark.parametrize("chain", [False, True], ids=["full-input", "previous_response_id"])
async def test_responses_loop(make_backend: Any, server: FakeOpenAIServer, chain: bool) -> None:
    dispatcher = ToolDispatcher(await started(make_backend))
    async with AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0) as client:
        answer, transcript = await responses_loop(client, dispatcher, "conv-resp", chain=chain)
    workspace = dispatcher.sessions.info()["conv-resp"]["workspace"]
    assert tool_outputs(transcript)[1] == f"{workspace}/proj\n[exit code 0]"
    assert answer.endswith("hello from the model\n[exit code 0]")
    if chain:  # only the tool results were sent after the first request
        assert all(x["type"] == "function_call_output" for r in server.requests[1:] for x in r["body"]["input"])
    check_server(server)


def test_sync_client_and_sync_dispatcher(server: FakeOpenAIServer) -> None:
    # Sync code: the backend lives on the portal loop, the dispatcher's handle_sync runs there.
    backend = ToolBackend(SandboxConfig(name="oa" + uuid.uuid4().hex[:6], slots_per_sandbox=4,
                                        min_sandboxes=1, max_sandboxes=2))
    run_sync(backend.start(), timeout=30)
    try:
        dispatcher = ToolDispatcher(backend)
        with OpenAI(base_url=server.base_url, api_key="test", max_retries=0) as client:
            messages: list[Any] = [{"role": "user", "content": PROMPT}]
            while True:
                completion = client.chat.completions.create(model="loop", messages=messages,
                                                            tools=openai_tools("chat"))
                messages.append(completion.choices[0].message)
                results = dispatcher.handle_sync(completion, "sync-chat", timeout=30)
                if not results:
                    break
                messages.extend(results)
            items: list[Any] = [{"role": "user", "content": PROMPT}]
            while True:
                response = client.responses.create(model="loop", input=items, tools=openai_tools("responses"))
                results = dispatcher.handle_sync(response.output, "sync-responses", timeout=30)
                items += [*response.output, *results]
                if not results:
                    break
        assert completion.choices[0].message.content.endswith("hello from the model\n[exit code 0]")
        assert response.output_text.endswith("hello from the model\n[exit code 0]")
        info = dispatcher.sessions.info()
        assert info["sync-chat"]["slot_id"] != info["sync-responses"]["slot_id"]
        check_server(server)
        assert run_sync(dispatcher.close_all(), timeout=30) == 2
    finally:
        run_sync(backend.stop(), timeout=30)


# -- mistakes, conversations, parallel calls -----------------------------------------------

async def test_mistakes_become_tool_messages_and_the_other_calls_still_run(
        make_backend: Any, server: FakeOpenAIServer) -> None:
    dispatcher = ToolDispatcher(await started(make_backend))
    async with AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0) as client:
        answer, transcript = await chat_loop(client, dispatcher, "conv-mistakes", model="mistakes")
    ok, bad_json, unknown, bad_args, bad_offset, last = tool_outputs(transcript)
    assert ok == "[exit code 0]"
    assert "arguments of bash are not valid JSON" in bad_json and "Nothing was run" in bad_json
    assert "unknown function 'delete_everything'" in unknown
    assert "bash, read_file, write_file" in unknown
    assert "invalid arguments for bash" in bad_args
    assert "command: Field required" in bad_args and "cmd: Extra inputs are not permitted" in bad_args
    assert "invalid arguments for read_file: offset: Input should be greater than or equal to 0" in bad_offset
    assert last == "one\nfour\n[exit code 0]"  # the refused calls ran nothing
    assert answer.endswith(last)
    check_server(server)  # every call, good or bad, was answered by its id


async def test_mistakes_in_plain_dicts(make_backend: Any) -> None:
    dispatcher = ToolDispatcher(await started(make_backend))
    outcomes = await dispatcher.dispatch([
        {"type": "reasoning", "id": "rs_1", "summary": []},  # skipped: not a function call
        {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": "[1, 2]"},
        {"type": "function_call", "call_id": "c2", "name": "bash", "arguments": ""},
        {"type": "function_call", "call_id": "c3", "name": "bash", "arguments": '{"command": "echo ok"}'},
    ], "conv-dicts")
    assert [o.call_id for o in outcomes] == ["c1", "c2", "c3"]
    assert "must be a JSON object, got list" in outcomes[0].message["output"]
    assert "command: Field required" in outcomes[1].message["output"]
    assert outcomes[0].result is None and outcomes[1].result is None
    assert outcomes[2].message == {"type": "function_call_output", "call_id": "c3", "output": "ok\n[exit code 0]"}
    assert outcomes[2].arguments == {"command": "echo ok", "background": False}
    assert outcomes[2].result.metadata["returncode"] == 0
    custom = await dispatcher.handle({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c4", "type": "custom", "custom": {"name": "patch", "input": "*** Begin"}}]}, "conv-dicts")
    assert custom[0]["tool_call_id"] == "c4" and "custom tool calls are not supported" in custom[0]["content"]


async def test_two_conversations_get_two_slots(make_backend: Any, server: FakeOpenAIServer) -> None:
    dispatcher = ToolDispatcher(await started(make_backend))
    async with AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0) as client:
        (_, alice), (_, bob) = await asyncio.gather(
            chat_loop(client, dispatcher, "alice"), responses_loop(client, dispatcher, "bob"))
    info = dispatcher.sessions.info()
    assert info["alice"]["slot_id"] != info["bob"]["slot_id"]
    assert info["alice"]["workspace"] != info["bob"]["workspace"]
    assert tool_outputs(alice)[1] == f"{info['alice']['workspace']}/proj\n[exit code 0]"
    assert tool_outputs(bob)[1] == f"{info['bob']['workspace']}/proj\n[exit code 0]"
    peek = await dispatcher.handle([{"id": "peek", "type": "function", "function": {
        "name": "bash", "arguments": f'{{"command": "cat {info["bob"]["workspace"]}/proj/notes.txt"}}'}}], "alice")
    assert "No such file or directory" in peek[0]["content"] and "[exit code 1" in peek[0]["content"]
    check_server(server)


async def test_parallel_calls_of_one_turn_run_in_order(make_backend: Any, server: FakeOpenAIServer) -> None:
    dispatcher = ToolDispatcher(await started(make_backend))
    async with AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0) as client:
        response = await client.responses.create(model="parallel", input=PROMPT, tools=openai_tools("responses"))
        outcomes = await dispatcher.dispatch(response, "conv-parallel")
        final = await client.responses.create(model="parallel", input=[
            {"role": "user", "content": PROMPT}, *response.output, *(o.message for o in outcomes)],
            tools=openai_tools("responses"))
    assert final.output_text == "ok"
    assert [o.call_id for o in outcomes] == [item.call_id for item in response.output]
    texts = [o.message["output"] for o in outcomes]
    assert texts[:6] == ["[exit code 0]"] * 6
    assert texts[6].startswith("started\n") and "[exit code 124 (timed out): command timed out after 0.5s" in texts[6]
    assert "No such file or directory" in texts[7] and texts[7].endswith("[exit code 2]")
    assert texts[8] == "0\n1\n2\n3\n4\n5\n"  # written in call order, read after them
    check_server(server)


# -- what the dispatcher accepts ---------------------------------------------------------

CHAT_BODY = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "bash", "arguments": '{"command": "echo a"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "bash", "arguments": '{"command": "echo b"}'}},
        ]}}],
}
RESPONSE_BODY = {
    "id": "resp_1", "object": "response", "created_at": 1, "model": "m", "parallel_tool_calls": True,
    "tool_choice": "auto", "tools": [], "output": [
        {"type": "function_call", "id": "fc_a", "call_id": "call_a", "name": "bash",
         "arguments": '{"command": "echo a"}', "status": "completed"},
        {"type": "function_call", "id": "fc_b", "call_id": "call_b", "name": "bash",
         "arguments": '{"command": "echo b"}', "status": "completed"}],
}


async def test_accepts_sdk_objects_and_plain_dicts(make_backend: Any) -> None:
    dispatcher = ToolDispatcher(await started(make_backend))
    completion = ChatCompletion.model_validate(CHAT_BODY)
    response = Response.model_validate(RESPONSE_BODY)
    chat_expected = [{"role": "tool", "tool_call_id": "call_a", "content": "a\n[exit code 0]"},
                     {"role": "tool", "tool_call_id": "call_b", "content": "b\n[exit code 0]"}]
    responses_expected = [{"type": "function_call_output", "call_id": "call_a", "output": "a\n[exit code 0]"},
                          {"type": "function_call_output", "call_id": "call_b", "output": "b\n[exit code 0]"}]
    message = completion.choices[0].message
    for form in (completion, message, CHAT_BODY, CHAT_BODY["choices"][0]["message"],
                 message.model_dump(), list(message.tool_calls)):
        assert await dispatcher.handle(form, "conv") == chat_expected
    for form in (response, response.output, RESPONSE_BODY, RESPONSE_BODY["output"]):
        assert await dispatcher.handle(form, "conv") == responses_expected
    assert await dispatcher.handle(response.output[0], "conv") == responses_expected[:1]
    # No function call: the turn is the model's answer.
    assert await dispatcher.handle({"role": "assistant", "content": "done"}, "conv") == []
    assert await dispatcher.handle({**RESPONSE_BODY, "output": []}, "conv") == []
    history = [{"role": "user", "content": "hi"}, CHAT_BODY["choices"][0]["message"], *chat_expected]
    for bad in (42, "echo hi", {"foo": 1}, history, [*RESPONSE_BODY["output"], *responses_expected]):
        with pytest.raises(UsageError):
            await dispatcher.handle(bad, "conv")
    with pytest.raises(UsageError):
        await dispatcher.handle(completion, None)  # type: ignore[arg-type]
    assert len(dispatcher.sessions) == 1


def test_format_result() -> None:
    assert format_result("bash", ExecutionResult(True, "", metadata={"returncode": 0})) == "[exit code 0]"
    assert format_result("bash", ExecutionResult(False, "x", "exit code 3", metadata={"returncode": 3})) \
        == "x\n[exit code 3]"
    timed_out = ExecutionResult(False, "partial", "command timed out after 2s",
                                metadata={"returncode": 124, "timed_out": True})
    assert format_result("bash", timed_out) == "partial\n[exit code 124 (timed out): command timed out after 2s]"
    assert format_result("read_file", ExecutionResult(True, "")) == "(empty)"
    assert format_result("read_file", ExecutionResult(False, "", "no such file: a", metadata={"returncode": 1})) \
        == "Error: no such file: a"
