"""``hermes-modal-tool mcp`` driven by the official MCP client (``mcp.ClientSession``),
over stdio and over streamable HTTP, as a desktop client or an agent framework would.

The server runs as its own process (the installed command) on local bubblewrap
sandboxes, sized by the same ``TERMINAL_MODAL_*`` variables as the other commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import ClientSession, MCPError, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from hermes_modal_tool.mcp_server import MCP_TOOL_SPECS

COMMAND = str(Path(sys.executable).with_name("hermes-modal-tool"))
ENV = {"TERMINAL_MODAL_SLOTS_PER_SANDBOX": "4", "TERMINAL_MODAL_MIN_SANDBOXES": "1",
       "TERMINAL_MODAL_MAX_SANDBOXES": "2", "TERMINAL_MODAL_MEMORY": "1024",
       "TERMINAL_MODAL_EXECUTION_TIMEOUT_S": "30"}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TERMINAL_", "ATROPOS_MODAL_"))}
    return {**env, **ENV, **extra}


def text(result: Any) -> str:
    return "".join(block.text for block in result.content)


def sleepers(tag: str) -> list[int]:
    """Host pids of processes running ``sleep TAG`` (the local driver's slots are host processes)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", tag.encode()]:
                    pids.append(int(entry.name))
    return pids


async def wait_gone(tag: str, within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    while sleepers(tag):
        assert time.monotonic() < deadline, f"'sleep {tag}' still running: {sleepers(tag)}"
        await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def stdio_session(**env: str) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=COMMAND, args=["mcp"], env=_env(**env))
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


class HttpServer:
    """A running ``hermes-modal-tool mcp --transport http``: its URL, the bearer token it
    printed, and the token's file."""

    def __init__(self, url: str, token: str, token_file: Path) -> None:
        self.url, self.token, self.token_file = url, token, token_file

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def start_http_server(runtime_dir: Path, *args: str) -> tuple[subprocess.Popen[str], list[str]]:
    """Start the HTTP server (``--port 0``, its token file under ``runtime_dir``); return
    it and its first stderr lines (the URL, then the token or the warning)."""
    proc = subprocess.Popen([COMMAND, "mcp", "--transport", "http", "--port", "0", *args],
                            env=_env(XDG_RUNTIME_DIR=str(runtime_dir)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    return proc, [proc.stderr.readline(), proc.stderr.readline()]


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    """``hermes-modal-tool mcp --transport http --port 0``; yields its URL and token."""
    proc, lines = start_http_server(tmp_path_factory.mktemp("run"), "--idle-lifetime", "2")
    try:
        match = re.search(r"serving (http://127\.0\.0\.1:\d+/mcp)", lines[0])
        assert match, f"no URL in the server's first line: {lines[0]!r}"
        auth = re.search(r"'Authorization: Bearer (\S+)' \(the token is also in (\S+), mode 0600\)", lines[1])
        assert auth, f"no token in the server's second line: {lines[1]!r}"
        yield HttpServer(match.group(1), auth.group(1), Path(auth.group(2)))
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, proc.stderr.read()


@contextlib.asynccontextmanager
async def http_session(server: HttpServer) -> AsyncIterator[ClientSession]:
    client = httpx2.AsyncClient(headers=server.headers, timeout=httpx2.Timeout(30, read=300))
    async with client, streamable_http_client(server.url, http_client=client) as (read, write), \
            ClientSession(read, write) as session:
        await session.initialize()
        yield session


async def check_tools_and_shell(session: ClientSession) -> None:
    listed = await session.list_tools()
    assert [t.name for t in listed.tools] == ["bash", "read_file", "write_file", "list_files", "expose_port",
                                             "unexpose_port"]
    for tool in listed.tools:
        spec = MCP_TOOL_SPECS[tool.name]
        assert tool.description == spec.description
        assert tool.input_schema == spec.json_schema()
    r = await session.call_tool("bash", {"command": "mkdir -p proj && cd proj && export GREETING=hi"})
    assert not r.is_error and r.structured_content["exit_code"] == 0
    r = await session.call_tool("bash", {"command": 'echo "$PWD $GREETING"'})
    assert text(r).startswith("/") and "/proj hi\n[exit code 0]" in text(r)
    r = await session.call_tool("write_file", {"path": "proj/a.py", "content": "print(6 * 7)\n"})
    assert not r.is_error, text(r)
    r = await session.call_tool("bash", {"command": "python3 a.py && (exit 3)"})
    assert text(r) == "42\n[exit code 3]" and not r.is_error
    r = await session.call_tool("read_file", {"path": "proj/a.py"})
    assert text(r) == "print(6 * 7)\n"
    r = await session.call_tool("list_files", {"path": "proj"})
    assert text(r).split() == ["a.py"]
    r = await session.call_tool("bash", {"command": "echo start; sleep 30", "timeout": 1})
    assert r.structured_content == {"exit_code": 124, "timed_out": True, "truncated": False}
    assert text(r).startswith("start\n") and "[exit code 124: command timed out" in text(r)
    assert not r.is_error
    r = await session.call_tool("bash", {"command": "pwd"})  # the shell survived, same directory
    assert text(r).split("\n")[0].endswith("/proj")
    # The model's mistakes are tool errors it reads; an unknown tool is a protocol error.
    r = await session.call_tool("read_file", {"path": "missing.txt"})
    assert r.is_error and "missing.txt" in text(r)
    r = await session.call_tool("bash", {"command": "ls", "timeout": -1})
    assert r.is_error and "timeout" in text(r)
    with pytest.raises(MCPError) as info:
        await session.call_tool("rm_rf", {})
    assert info.value.code == -32602 and "rm_rf" in str(info.value)


async def workspace(session: ClientSession) -> str:
    # A slot sees only its own workspace under the base (HOME is /root, the slot's own).
    r = await session.call_tool("bash", {"command": "ls -d /data/slot_*"})
    return text(r).split("\n")[0]


# -- stdio -------------------------------------------------------------------------------

async def test_stdio_tools_shell_and_errors() -> None:
    async with stdio_session() as session:
        await check_tools_and_shell(session)


async def test_stdio_two_sessions_two_slots() -> None:
    async with stdio_session() as a, stdio_session() as b:
        await a.call_tool("write_file", {"path": "mine.txt", "content": "a"})
        assert text(await b.call_tool("list_files", {})) == "(empty)"
        assert text(await a.call_tool("list_files", {})).split() == ["mine.txt"]


async def disconnect_mid_command(session_cm: Any, tag: str) -> None:
    """Start `sleep TAG` through the session, drop the session while it runs, and check that
    the command's process is gone afterwards."""
    async with session_cm as session:
        call = asyncio.ensure_future(session.call_tool("bash", {"command": f"sleep {tag}"}))
        deadline = time.monotonic() + 20
        while not sleepers(tag):
            assert time.monotonic() < deadline and not call.done(), "the command never started"
            await asyncio.sleep(0.1)
        call.cancel()
    await wait_gone(tag)


async def test_stdio_disconnect_mid_command_leaves_nothing_running() -> None:
    await disconnect_mid_command(stdio_session(), "913.25")


def test_stdio_malformed_input_gets_protocol_errors() -> None:
    """Raw lines on the server's stdin: an unknown method and bad params are answered
    with JSON-RPC errors; a line that is not JSON is skipped; the server goes on serving."""
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}
    lines = ["this is not json", json.dumps(init),
             json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}),
             json.dumps({"jsonrpc": "2.0", "id": 2, "method": "no/such_method"}),
             json.dumps({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": 5}}),
             json.dumps({"jsonrpc": "2.0", "id": 4, "method": "tools/list"})]
    proc = subprocess.Popen([COMMAND, "mcp"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env(), text=True)
    proc.stdin.write("\n".join(lines) + "\n")
    proc.stdin.flush()
    answers: dict[Any, dict[str, Any]] = {}
    try:
        while 4 not in answers:  # stdin stays open until the last answer (EOF ends the session)
            line = proc.stdout.readline()
            assert line, f"the server closed its output early: {proc.stderr.read()}"
            message = json.loads(line)
            answers[message.get("id")] = message
    finally:
        proc.stdin.close()
        assert proc.wait(30) == 0, proc.stderr.read()
    assert answers[1]["result"]["serverInfo"]["name"] == "hermes-modal-tool"
    assert answers[2]["error"]["code"] == -32601
    assert answers[3]["error"]["code"] == -32602
    assert [t["name"] for t in answers[4]["result"]["tools"]] == list(MCP_TOOL_SPECS)
    # A line that is not JSON has no id to answer: the SDK drops it (logged on stderr)
    # and goes on serving, as the answers after it show.


# -- streamable HTTP -------------------------------------------------------------------------

async def test_http_tools_shell_and_errors(http_server: HttpServer) -> None:
    async with http_session(http_server) as session:
        await check_tools_and_shell(session)


async def test_http_two_concurrent_sessions_two_slots(http_server: HttpServer) -> None:
    async with http_session(http_server) as a, http_session(http_server) as b:
        homes = await asyncio.gather(workspace(a), workspace(b))
        assert homes[0] != homes[1]
        await a.call_tool("write_file", {"path": "mine.txt", "content": "a"})
        assert text(await b.call_tool("list_files", {})) == "(empty)"
        assert homes[0] == await workspace(a)  # each keeps its own slot


async def test_http_disconnect_mid_command_leaves_nothing_running(http_server: HttpServer) -> None:
    await disconnect_mid_command(http_session(http_server), "917.75")


async def test_http_idle_session_slot_is_released(http_server: HttpServer) -> None:
    """The server runs with --idle-lifetime 2: a session quiet for longer loses its slot
    (a later call gets a fresh, empty one)."""
    async with http_session(http_server) as session:
        await session.call_tool("write_file", {"path": "kept.txt", "content": "x"})
        assert text(await session.call_tool("list_files", {})).split() == ["kept.txt"]
        await asyncio.sleep(4)
        with contextlib.suppress(MCPError):  # the session may have been ended with its slot
            assert text(await session.call_tool("list_files", {})) == "(empty)"
            return
    async with http_session(http_server) as fresh:
        assert text(await fresh.call_tool("list_files", {})) == "(empty)"


def test_http_malformed_request_gets_protocol_error(http_server: HttpServer) -> None:
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    headers.update(http_server.headers)
    bad = httpx.post(http_server.url, content=b"{not json", headers=headers, timeout=10)
    assert bad.status_code in (400, 422) and bad.json()["error"]["code"] == -32700
    after = httpx.post(http_server.url, headers=headers, timeout=10, json={
        "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}})
    assert after.status_code == 200, after.text  # still serving


def test_config_snippet_command_exists() -> None:
    """The README's client config names the installed command."""
    assert shutil.which("hermes-modal-tool", path=str(Path(sys.executable).parent))


def test_bad_profile_or_profiles_file_is_a_clear_error(tmp_path: Path) -> None:
    """The same flags and variables as the other commands, and the same clear errors."""
    bad = subprocess.run([COMMAND, "mcp", "--profile", "gpu-large"], env=_env(), capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert bad.returncode != 0 and "gpu-large" in bad.stderr and "default" in bad.stderr
    missing = tmp_path / "nope.yaml"
    via_env = subprocess.run([COMMAND, "mcp"], env=_env(TERMINAL_MODAL_PROFILES_FILE=str(missing)),
                             capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert via_env.returncode != 0 and str(missing) in via_env.stderr
    profiles = tmp_path / "profiles.yaml"
    profiles.write_text("default_profile: small\nprofiles:\n  small: {slots_per_sandbox: 2, max_pool: 1}\n")
    ok = subprocess.run([COMMAND, "mcp", "--profiles-file", str(profiles), "--driver", "local"], env=_env(),
                        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert ok.returncode == 0, ok.stderr  # served, then the client (no stdin) went away


# -- authentication (HTTP) ----------------------------------------------------------------

def test_http_requires_the_bearer_token_before_any_tool_runs(http_server: HttpServer) -> None:
    """Any local user reaches 127.0.0.1: a request without the server's token (none, a
    wrong one, a prefix of it, another scheme) gets 401 and runs nothing, even inside a
    session opened with the token; the same call with it runs (positive control). The
    token's file is the owner's only (0600)."""
    assert http_server.token_file.stat().st_mode & 0o777 == 0o600
    assert http_server.token_file.read_text().strip() == http_server.token
    base = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    auth = http_server.headers
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}
    for bad in ({}, {"Authorization": "Bearer " + "A" * len(http_server.token)},
                {"Authorization": "Bearer " + http_server.token[:-1]}, {"Authorization": http_server.token}):
        refused = httpx.post(http_server.url, headers={**base, **bad}, json=init, timeout=10)
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer"), refused
    opened = httpx.post(http_server.url, headers={**base, **auth}, json=init, timeout=10)
    assert opened.status_code == 200, opened.text
    session = {**base, "Mcp-Session-Id": opened.headers["mcp-session-id"], "Mcp-Protocol-Version": "2025-06-18"}
    note = httpx.post(http_server.url, headers={**session, **auth}, timeout=10,
                      json={"jsonrpc": "2.0", "method": "notifications/initialized"})
    assert note.status_code == 202, note.text
    tag = "927.25"
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "bash", "arguments": {"command": f"sleep {tag}", "background": True}}}
    for bad in ({}, {"Authorization": "Bearer not-the-token-" + "x" * 30}):
        refused = httpx.post(http_server.url, headers={**session, **bad}, json=call, timeout=10)
        assert refused.status_code == 401, refused.text
    time.sleep(1.0)
    assert not sleepers(tag), "a tool ran for a request without the token"
    ran = httpx.post(http_server.url, headers={**session, **auth}, json=call, timeout=30)
    assert ran.status_code == 200 and "started background job" in ran.text, ran.text
    deadline = time.monotonic() + 10
    while not sleepers(tag):
        assert time.monotonic() < deadline, "the authorized call did not run"
        time.sleep(0.1)
    httpx.delete(http_server.url, headers={**session, **auth}, timeout=10)  # the session ends: released


def test_http_token_file_and_no_auth(tmp_path: Path) -> None:
    """``--token-file`` must be the owner's only; ``--no-auth`` serves anyone, with a warning."""
    loose = tmp_path / "token"
    loose.write_text("a-token-of-enough-length-123456\n")
    loose.chmod(0o644)
    bad = subprocess.run([COMMAND, "mcp", "--transport", "http", "--port", "0", "--token-file", str(loose)],
                         env=_env(), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert bad.returncode != 0 and str(loose) in bad.stderr and "chmod 600" in bad.stderr, bad.stderr
    proc, lines = start_http_server(tmp_path, "--no-auth")
    try:
        assert "WARNING: --no-auth" in lines[1], lines
        url = re.search(r"serving (\S+)", lines[0]).group(1)
        r = httpx.post(url, timeout=10, json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}},
            headers={"Content-Type": "application/json", "Accept": "application/json, text/event-stream"})
        assert r.status_code == 200, r.text
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
