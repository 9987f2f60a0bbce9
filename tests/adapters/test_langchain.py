"""The LangChain adapter: standard tool suites, agent loops, threads, Deep Agents.

Real sandboxes throughout. Most tests share one backend started on the sync
portal's loop (as a sync LangChain app would start it); one test starts its own
on the test's loop (as an async app would).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import BaseTool
from langchain_helpers import SIZES, ScriptedChatModel, portal_backend, steps
from langchain_tests.integration_tests import ToolsIntegrationTests
from langchain_tests.unit_tests import ToolsUnitTests
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.func import entrypoint
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from hermes_modal_tool import ExecutionResult, SandboxConfig, ToolBackend, UsageError
from hermes_modal_tool.adapters.langchain import (
    OUTPUT_EVENT,
    BashTool,
    ReadFileTool,
    SandboxToolkit,
    WriteFileTool,
)
from hermes_modal_tool.sessions import SlotSessions
from hermes_modal_tool.tools import TOOL_SPECS


@pytest.fixture(scope="module")
def backend() -> Iterator[ToolBackend]:
    with portal_backend() as b:
        yield b


@pytest.fixture(scope="module")
def sessions(backend: ToolBackend) -> SlotSessions:
    """One key -> slot map for the standard suites (each of their tests builds a new tool)."""
    return SlotSessions(backend)


def thread(tid: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": tid}}


def call(name: str, args: dict[str, Any], cid: str = "c1") -> dict[str, Any]:
    return {"type": "tool_call", "id": cid, "name": name, "args": args}


# -- LangChain's standard tool suites -------------------------------------------------

class _Standard:
    tool_class: type[BaseTool]
    example: dict[str, Any]

    @pytest.fixture(autouse=True)
    def _use_sessions(self, sessions: SlotSessions) -> None:
        self.sessions = sessions

    @property
    def tool_constructor(self) -> type[BaseTool]:
        return self.tool_class

    @property
    def tool_constructor_params(self) -> dict[str, Any]:
        return {"sessions": self.sessions, "trajectory_id": "standard-suite"}

    @property
    def tool_invoke_params_example(self) -> dict[str, Any]:
        return self.example


class TestBashToolUnit(_Standard, ToolsUnitTests):
    tool_class = BashTool
    example = {"command": "echo hello", "timeout": 5}


class TestBashToolIntegration(_Standard, ToolsIntegrationTests):
    tool_class = BashTool
    example = {"command": "echo hello", "timeout": 5}


class TestReadFileToolUnit(_Standard, ToolsUnitTests):
    tool_class = ReadFileTool
    example = {"path": "notes.txt", "offset": 0, "limit": 10}


class TestReadFileToolIntegration(_Standard, ToolsIntegrationTests):
    tool_class = ReadFileTool
    example = {"path": "notes.txt", "offset": 0, "limit": 10}


class TestWriteFileToolUnit(_Standard, ToolsUnitTests):
    tool_class = WriteFileTool
    example = {"path": "notes.txt", "content": "line 1\nline 2\n"}


class TestWriteFileToolIntegration(_Standard, ToolsIntegrationTests):
    tool_class = WriteFileTool
    example = {"path": "notes.txt", "content": "line 1\nline 2\n"}


# -- the tool contract ------------------------------------------------------------------

def test_tools_take_their_contract_from_tool_specs(backend: ToolBackend) -> None:
    tools = SandboxToolkit(backend, "contract").get_tools()
    assert [t.name for t in tools] == ["bash", "read_file", "write_file"]
    for tool in tools:
        spec = TOOL_SPECS[tool.name]
        assert tool.description == spec.description
        assert tool.args_schema is spec.args_model
        assert tool.response_format == "content_and_artifact"
        # What the model is shown: the spec's properties, nothing injected (no `config`).
        shown = tool.tool_call_schema.model_json_schema()
        assert set(shown["properties"]) == set(spec.json_schema()["properties"])
    assert type(tools[0])._arun is not BaseTool._arun  # real async, not the executor fallback
    assert [t.name for t in SandboxToolkit(backend, tools=("bash",)).get_tools()] == ["bash"]
    with pytest.raises(ValueError, match="unknown tools"):
        SandboxToolkit(backend, tools=("rm_rf",))


def test_failures_come_back_as_content_with_the_result_as_artifact(backend: ToolBackend) -> None:
    bash, read_file, write_file = SandboxToolkit(backend, "failures").get_tools()

    ok = bash.invoke(call("bash", {"command": "echo hi"}))
    assert isinstance(ok, ToolMessage) and ok.content == "hi\n[exit code 0]"
    assert isinstance(ok.artifact, ExecutionResult) and ok.artifact.success

    failed = bash.invoke(call("bash", {"command": "echo oops >&2; false"}))
    assert failed.content == "oops\n[exit code 1]"
    assert failed.artifact.returncode == 1 and not failed.artifact.success

    slow = bash.invoke(call("bash", {"command": "echo started; sleep 10", "timeout": 0.5}))
    assert slow.content.startswith("started\n")
    assert "[exit code 124: command timed out after 0.5s" in slow.content
    assert slow.artifact.metadata["timed_out"]

    outside = read_file.invoke(call("read_file", {"path": "/etc/shadow"}))  # the slot's permissions
    assert outside.content.startswith("Error: ") and "/etc/shadow" in outside.content
    assert outside.artifact.success is False
    missing = read_file.invoke(call("read_file", {"path": "missing.txt"}))
    assert missing.content.startswith("Error: no such file")

    wrote = write_file.invoke(call("write_file", {"path": "a/b.txt", "content": "x\ny\n"}))
    assert wrote.content.startswith("wrote 4 bytes to /data/slot_")
    assert read_file.invoke({"path": "a/b.txt", "offset": 1}) == "y\n"
    # The shell stays usable after a timeout, in the same directory.
    assert bash.invoke({"command": "cd a && echo ok"}) == "ok\n[exit code 0]"
    assert bash.invoke({"command": "pwd"}).startswith("/data/slot_")
    assert bash.invoke({"command": "pwd"}).split("\n")[0].endswith("/a")


async def test_async_tools_reach_a_backend_on_another_loop(backend: ToolBackend) -> None:
    # The backend runs on the portal loop; this test runs on its own loop.
    bash, _, write_file = SandboxToolkit(backend).get_tools()
    await write_file.ainvoke({"path": "f.txt", "content": "async"}, thread("async-1"))
    results = await asyncio.gather(*(bash.ainvoke({"command": "cat f.txt 2>&1; pwd"}, thread(t))
                                     for t in ("async-1", "async-2")))
    assert results[0].startswith("async/data/slot_")
    assert "No such file" in results[1] and "[exit code 0]" in results[1]


async def test_bash_output_streams_as_custom_events(backend: ToolBackend) -> None:
    bash = SandboxToolkit(backend).get_tools()[0]
    events = [e async for e in bash.astream_events(
        {"command": "echo one; sleep 0.2; echo two >&2; echo three"}, thread("stream-1"), version="v2")]
    custom = [e for e in events if e["event"] == "on_custom_event"]
    assert {e["name"] for e in custom} == {OUTPUT_EVENT}
    streams = {"stdout": "", "stderr": ""}
    for e in custom:
        streams[e["data"]["stream"]] += e["data"]["data"]
    assert streams == {"stdout": "one\nthree\n", "stderr": "two\n"}
    [tool_run] = {e["run_id"] for e in events if e["event"] == "on_tool_start"}
    assert all(e["run_id"] == tool_run for e in custom)  # events of the tool's own run
    [end] = [e for e in events if e["event"] == "on_tool_end"]
    assert end["data"]["output"].endswith("[exit code 0]")
    order = [e["event"] for e in events]
    assert order.index("on_custom_event") < order.index("on_tool_end")


async def test_backend_on_the_callers_loop() -> None:
    # An async app: the backend is started on the loop the agent runs on.
    # (Not conftest's make_backend: its leftover check counts the module backend's agents.)
    backend = ToolBackend(SandboxConfig(name="lcown" + uuid.uuid4().hex[:6], **{**SIZES, "slots_per_sandbox": 2}))
    await backend.start()
    try:
        toolkit = SandboxToolkit(backend, "own-loop")
        bash = toolkit.get_tools()[0]
        assert await bash.ainvoke({"command": "export X=42"}) == "(no output)\n[exit code 0]"
        assert await bash.ainvoke({"command": "echo $X"}) == "42\n[exit code 0]"
        # A sync call from the loop the backend runs on would deadlock: a clear error instead.
        with pytest.raises(UsageError, match="use the async API"):
            bash.invoke({"command": "echo no"})
        assert await toolkit.aclose() == 1
    finally:
        await backend.stop()


# -- agent loops ----------------------------------------------------------------------

def test_create_agent_keeps_cd_per_thread_and_separates_threads(backend: ToolBackend) -> None:
    toolkit = SandboxToolkit(backend)  # no trajectory_id: the thread_id picks the slot
    agent = create_agent(ScriptedChatModel(), toolkit.get_tools(), checkpointer=InMemorySaver())

    out_a = agent.invoke({"messages": [steps(
        ("bash", {"command": "mkdir -p proj && cd proj && export STAGE=build"}),
        ("write_file", {"path": "proj/mark.txt", "content": "from a\n"}),
        ("bash", {"command": "pwd; echo $STAGE; cat mark.txt"}),
    )]}, thread("a"))
    tool_messages = [m for m in out_a["messages"] if isinstance(m, ToolMessage)]
    assert [m.name for m in tool_messages] == ["bash", "write_file", "bash"]
    pwd_a, stage, mark, status = tool_messages[-1].content.split("\n")
    assert pwd_a.startswith("/data/slot_") and pwd_a.endswith("/proj")
    assert (stage, mark, status) == ("build", "from a", "[exit code 0]")
    assert out_a["messages"][-1].content == tool_messages[-1].content

    out_b = agent.invoke({"messages": [steps(
        ("bash", {"command": "pwd; ls -A; cat proj/mark.txt"}),
    )]}, thread("b"))
    pwd_b, *rest = out_b["messages"][-1].content.split("\n")
    assert pwd_b.startswith("/data/slot_") and not pwd_b.endswith("/proj")
    assert "No such file" in "\n".join(rest) and rest[-1] == "[exit code 1]"

    # Thread a again (same checkpointed conversation): still in proj, file still there.
    again = agent.invoke({"messages": [steps(("read_file", {"path": "proj/mark.txt"}),
                                             ("bash", {"command": "pwd"}))]}, thread("a"))
    assert again["messages"][-1].content == f"{pwd_a}\n[exit code 0]"
    assert "from a\n" in [m.content for m in again["messages"] if isinstance(m, ToolMessage)]

    info = toolkit.info()
    assert set(info) == {"a", "b"} and info["a"]["slot_id"] != info["b"]["slot_id"]
    assert toolkit.close(thread("b")) == 1 and set(toolkit.info()) == {"a"}
    assert toolkit.close() == 1


async def test_tool_node_runs_two_threads_concurrently(backend: ToolBackend) -> None:
    toolkit = SandboxToolkit(backend)
    graph = (StateGraph(MessagesState).add_node("tools", ToolNode(toolkit.get_tools()))
             .add_edge(START, "tools").add_edge("tools", END).compile())

    async def run(tid: str, command: str) -> ToolMessage:
        request = AIMessage(content="", tool_calls=[call("bash", {"command": command}, f"id-{tid}")])
        out = await graph.ainvoke({"messages": [request]}, thread(tid))
        return out["messages"][-1]

    await asyncio.gather(run("x", "echo x > who"), run("y", "echo y > who"))
    x, y = await asyncio.gather(run("x", "cat who; pwd"), run("y", "cat who; pwd"))
    assert x.content.startswith("x\n/data/slot_") and y.content.startswith("y\n/data/slot_")
    assert x.artifact.slot_id != y.artifact.slot_id
    assert await toolkit.aclose() == 2


# -- Deep Agents --------------------------------------------------------------------

def test_create_deep_agent_runs_in_a_slot(backend: ToolBackend) -> None:
    from deepagents import create_deep_agent

    from hermes_modal_tool.adapters.langchain import SlotSandbox

    sandbox = SlotSandbox(backend, "deep-1")
    workspace = sandbox.slot().workspace_dir
    agent = create_deep_agent(model=ScriptedChatModel(), backend=sandbox)
    out = agent.invoke({"messages": [steps(
        ("execute", {"command": "mkdir -p src && cd src && echo made"}),
        ("write_file", {"file_path": f"{workspace}/src/hello.py", "content": "print('hello from deep agents')\n"}),
        ("execute", {"command": "pwd && python3 hello.py"}),
    )]})
    tool_messages = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert [m.name for m in tool_messages] == ["execute", "write_file", "execute"]
    assert all(m.status == "success" for m in tool_messages)
    last = tool_messages[-1].content
    assert f"{workspace}/src" in last and "hello from deep agents" in last
    # The agent's `cd src` persists in the slot's shell, for direct calls too.
    assert sandbox.execute("cat hello.py").output == "print('hello from deep agents')\n"
    assert sandbox.close() == 1


def test_deep_agent_and_toolkit_share_a_threads_slot(backend: ToolBackend) -> None:
    from hermes_modal_tool.adapters.langchain import SlotSandbox

    toolkit = SandboxToolkit(backend)
    sandbox = SlotSandbox(backend, sessions=toolkit.sessions)  # thread_id from the LangGraph run
    bash = toolkit.get_tools()[0]
    bash.invoke({"command": "echo shared > s.txt"}, thread("t1"))

    @entrypoint()
    def read_back(path: str) -> str:
        return sandbox.execute(f"cat {path}").output

    assert read_back.invoke("s.txt", thread("t1")) == "shared\n"
    assert "No such file" in read_back.invoke("s.txt", thread("t2"))
    assert toolkit.close() == 2


async def test_slot_sandbox_timeouts_permissions_and_no_transfer_leftovers(backend: ToolBackend) -> None:
    from hermes_modal_tool.adapters.langchain import SlotSandbox

    sandbox = SlotSandbox(backend, "deep-2")
    slow = await sandbox.aexecute("echo begun; sleep 10", timeout=1)
    assert slow.exit_code == 124 and slow.output.startswith("begun\n")
    assert "timed out after 1s" in slow.output
    assert (await sandbox.aexecute("echo fine", timeout=0)).output == "fine\n"  # 0: no limit
    with pytest.raises(ValueError, match="non-negative"):
        await sandbox.aexecute("true", timeout=-1)

    workspace = (await sandbox.aslot()).workspace_dir
    up = await sandbox.aupload_files([(f"{workspace}/in/ws.bin", b"\x00\xff"), ("/tmp/t.txt", b"t"),
                                      ("/etc/shadow", b"x"), ("relative.txt", b"x")])
    assert [r.error for r in up] == [None, None, "permission_denied", "invalid_path"]
    down = await sandbox.adownload_files([f"{workspace}/in/ws.bin", "/tmp/t.txt", "/etc/shadow", "/tmp"])
    assert [(r.content, r.error) for r in down] == [
        (b"\x00\xff", None), (b"t", None), (None, "permission_denied"), (None, "is_directory")]
    listing = await sandbox.aexecute(f"ls -A {workspace}")
    assert listing.output == "in\n"  # transfers leave nothing behind
    assert await sandbox.aclose() == 1
