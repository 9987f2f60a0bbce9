"""``SlotSandboxSession``'s PTY sessions (``pty_exec_start``/``pty_write_stdin``/
``pty_terminate_all``) as the Agents SDK's ``exec_command`` and ``write_stdin`` tools use
them: a Python REPL on a terminal answered through stdin with output read incrementally,
commands on pipes, exit codes, truncation, timeouts, termination and release; and a
``Runner.run`` whose scripted model drives a REPL with both tools. Runs in ``.venv-agents``
(see test_openai_agents.py)."""

# ruff: noqa: E402  (the SDK is imported after the skip-or-fail check below)
from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest
from support import require_agents_sdk

require_agents_sdk()

from agents import Runner, set_tracing_disabled
from agents.sandbox.capabilities.tools.shell_tool import ExecCommandArgs, ExecCommandTool
from agents.sandbox.errors import ExecTransportError, PtySessionNotFoundError
from image_builder import images_for_tests
from support import eventually, processes
from test_openai_agents import _tool_outputs, agent_for, run_config

from hermes_modal_tool.adapters.openai_agents import SlotSandboxClient, SlotSandboxClientOptions
from hermes_modal_tool.testing.openai_server import FakeOpenAIServer, TextTurn, ToolTurn

set_tracing_disabled(True)


async def test_a_python_repl_on_a_terminal(make_backend: Any) -> None:
    client = SlotSandboxClient(await make_backend())
    session = await client.create(options=SlotSandboxClientOptions())
    async with session:
        assert session.supports_pty()
        up = await session.pty_exec_start("python3 -q", tty=True, yield_time_s=3)
        assert up.exit_code is None and up.process_id is not None and b">>> " in up.output
        sid = up.process_id
        up = await session.pty_write_stdin(session_id=sid, chars="name = input('name? ')\n", yield_time_s=1)
        assert b"name? " in up.output and up.process_id == sid
        await session.pty_write_stdin(session_id=sid, chars="Ada\n")
        up = await session.pty_write_stdin(session_id=sid, chars="print('hi', name)\n", yield_time_s=1)
        assert b"hi Ada" in up.output
        # Output arrives incrementally: each update holds what came since the last one.
        await session.pty_write_stdin(session_id=sid, chars="import time\n")
        loop = "for i in range(4): print('tick', i, flush=True); time.sleep(0.6)\n\n"
        first = await session.pty_write_stdin(session_id=sid, chars=loop, yield_time_s=1)
        assert b"tick 0" in first.output and b"tick 3" not in first.output and first.exit_code is None
        rest = await session.pty_write_stdin(session_id=sid, chars="")  # a poll: up to 5 s
        assert b"tick 3" in rest.output and b"tick 0" not in rest.output
        # Ctrl-C reaches the program through the terminal.
        await session.pty_write_stdin(session_id=sid, chars="time.sleep(60)\n", yield_time_s=0.5)
        up = await session.pty_write_stdin(session_id=sid, chars="\x03", yield_time_s=2)
        assert b"KeyboardInterrupt" in up.output
        # The end comes early (no waiting out the yield time) with the exit code.
        started = time.monotonic()
        up = await session.pty_write_stdin(session_id=sid, chars="exit(3)\n", yield_time_s=10)
        assert (up.exit_code, up.process_id) == (3, None) and time.monotonic() - started < 5
        with pytest.raises(PtySessionNotFoundError):
            await session.pty_write_stdin(session_id=sid, chars="more\n")


async def test_commands_on_pipes_truncation_and_timeout(make_backend: Any) -> None:
    client = SlotSandboxClient(await make_backend())
    session = await client.create(options=SlotSandboxClientOptions())
    async with session:
        started = time.monotonic()
        up = await session.pty_exec_start("echo out; echo err >&2; exit 4", yield_time_s=10)
        assert (up.exit_code, up.process_id) == (4, None) and time.monotonic() - started < 5
        assert up.output == b"out\nerr\n"  # no terminal: no \r\n, the streams interleaved
        assert (await session.pty_exec_start("cat", yield_time_s=10)).exit_code == 0  # stdin: /dev/null
        up = await session.pty_exec_start("for i in 1 2 3; do echo line$i; sleep 0.8; done", yield_time_s=0.5)
        assert up.exit_code is None and b"line3" not in up.output
        with pytest.raises(RuntimeError, match="stdin is not available for this process"):
            await session.pty_write_stdin(session_id=up.process_id, chars="x")
        done = await session.pty_write_stdin(session_id=up.process_id, chars="", yield_time_s=10)
        assert done.exit_code == 0 and up.output + done.output == b"line1\nline2\nline3\n"  # each line once
        cut = await session.pty_exec_start("seq 1 20000", yield_time_s=10, max_output_tokens=50)
        assert cut.exit_code == 0 and cut.original_token_count and cut.original_token_count > 50
        assert len(cut.output) < 1000 and cut.output.startswith(b"Total output lines: 20000")
        started = time.monotonic()
        killed = await session.pty_exec_start("sleep 30", timeout=1, yield_time_s=10)
        assert killed.exit_code == -9 and time.monotonic() - started < 8


async def test_terminate_all_and_release_end_the_processes(make_backend: Any) -> None:
    backend = await make_backend()
    client = SlotSandboxClient(backend)
    session = await client.create(options=SlotSandboxClientOptions())
    await session.start()
    slot = await client.sessions.slot(session.state.slot_key)
    on_tty = await session.pty_exec_start("sleep 4243", tty=True, yield_time_s=0.25)
    on_pipes = await session.pty_exec_start("sleep 4244", yield_time_s=0.25)
    assert on_tty.exit_code is None and on_pipes.exit_code is None
    assert sum(p["running"] for p in await backend.list_processes(slot)) == 2
    await session.pty_terminate_all()
    assert not await eventually(lambda: _sleeping("4243", "4244"), lambda alive: not alive, timeout=20)
    for up in (on_tty, on_pipes):
        with pytest.raises(PtySessionNotFoundError):
            await session.pty_write_stdin(session_id=up.process_id, chars="")
    # Releasing the slot (the runner's delete) ends what is still running.
    await session.pty_exec_start("sleep 4245", yield_time_s=0.25)
    await client.delete(session)
    assert not await eventually(lambda: _sleeping("4245"), lambda alive: not alive, timeout=20)


async def test_pty_sessions_can_be_turned_off(make_backend: Any) -> None:
    client = SlotSandboxClient(await make_backend())
    session = await client.create(options=SlotSandboxClientOptions(pty=False))
    async with session:
        assert not session.supports_pty()
        out = await ExecCommandTool(session=session).run(ExecCommandArgs(cmd="echo one-shot; sleep 0.2"))
        assert "Process exited with code 0" in out and "session ID" not in out
        resumed = await client.resume(client.deserialize_session_state(client.serialize_session_state(session.state)))
        assert not resumed.supports_pty()


async def test_without_python3_exec_command_falls_back_to_one_shot(make_backend: Any, tmp_path_factory: Any,
                                                                   tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("HERMES_MODAL_TOOL_IMAGE_CACHE", str(tmp_path / "cache"))
    images = images_for_tests(tmp_path_factory)  # busybox only: no python3
    client = SlotSandboxClient(await make_backend(image=images["two"]))
    session = await client.create(options=SlotSandboxClientOptions())
    async with session:
        with pytest.raises(ExecTransportError) as failed:
            await session.pty_exec_start("echo hi", tty=True)
        assert failed.value.context["retry_safe"] is True and "python3 is not in the slot" in str(failed.value)
        out = await ExecCommandTool(session=session).run(ExecCommandArgs(cmd="echo one-shot"))
        assert "fell back to one-shot exec" in out and "Process exited with code 0" in out
        assert out.endswith("Output:\nPTY transport failed before the interactive session opened; "
                            "fell back to one-shot exec.\none-shot\n")


def with_session_id(**fields: Any) -> Callable[[list[str]], dict[str, Any]]:
    """``write_stdin`` arguments whose ``session_id`` the scripted model reads from the
    tool results it was just sent, as a real model would."""

    def arguments(results: list[str]) -> dict[str, Any]:
        found = re.search(r"Process running with session ID (\d+)", "\n".join(results))
        assert found, results
        return {"session_id": int(found.group(1)), **fields}

    return arguments


async def test_runner_drives_a_repl_with_exec_command_and_write_stdin(make_backend: Any) -> None:
    backend = await make_backend()
    client = SlotSandboxClient(backend)
    script = [ToolTurn([("exec_command", {"cmd": "python3 -q", "tty": True, "yield_time_ms": 2000})]),
              ToolTurn([("write_stdin", with_session_id(chars="x = input('x? ')\n", yield_time_ms=1000))]),
              ToolTurn([("write_stdin", with_session_id(chars="6\nprint(int(x) * 7)\nexit(5)\n",
                                                        yield_time_ms=10000))]),
              TextTurn("{last_output}")]
    with FakeOpenAIServer(script, require_strict=False) as server:
        result = await Runner.run(agent_for(server), "Ask Python for x, answer 6, print x*7.",
                                  run_config=run_config(client))
        server.check()
    first = [r for r in server.requests if r["path"].endswith("/responses")][0]["body"]
    assert {"exec_command", "write_stdin"} <= {t.get("name") for t in first["tools"]}
    outputs = [o["output"] for o in _tool_outputs(server)]
    assert "Process running with session ID" in outputs[0] and ">>> " in outputs[0]
    assert "x? " in outputs[1]
    assert "Process exited with code 5" in result.final_output and "42" in result.final_output
    assert len(client.sessions) == 0  # the runner deleted its session: the slot is back


async def _sleeping(*markers: str) -> bool:
    return any(f"sleep\x00{m}".encode() in p.cmdline for p in processes().values() for m in markers)
