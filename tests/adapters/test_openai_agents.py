"""``SlotSandboxClient`` under the OpenAI Agents SDK's own runner.

``Runner.run`` with a ``SandboxAgent`` (the SDK's default capabilities: shell,
filesystem, compaction) is driven by the real ``openai`` client against the local
OpenAI-compatible server with scripted tool calls. The session API itself is checked
the way the SDK's runtime uses it: exec, read/write, persist/hydrate, resume.

The Agents SDK (``openai-agents`` 0.24) needs ``openai>=3``, which the Hermes agent's
pin (``openai==2.24``) excludes, so these tests run in their own environment
(``.venv-agents``, made by ``scripts/setup.sh``; ``scripts/test.sh`` runs them).
"""

# ruff: noqa: E402  (the SDK is imported after the skip-or-fail check below)
from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import pytest
from support import require_agents_sdk

require_agents_sdk()

from agents import RunConfig, Runner, set_tracing_disabled
from agents.models.openai_responses import OpenAIResponsesModel
from agents.sandbox import SandboxAgent, SandboxRunConfig
from agents.sandbox.errors import (
    ExecTimeoutError,
    ExposedPortUnavailableError,
    InvalidManifestPathError,
    WorkspaceReadNotFoundError,
)
from agents.sandbox.snapshot import LocalSnapshotSpec
from openai import AsyncOpenAI

from hermes_modal_tool.adapters.openai_agents import (
    SlotSandboxClient,
    SlotSandboxClientOptions,
    SlotSandboxSessionState,
)
from hermes_modal_tool.errors import ConfigError
from hermes_modal_tool.testing.openai_server import FakeOpenAIServer, TextTurn, ToolTurn

set_tracing_disabled(True)

CODING = [ToolTurn([("exec_command", {"cmd": "printf 'print(6 * 7)\\n' > hello.py"})]),
          ToolTurn([("exec_command", {"cmd": "python3 hello.py > out.txt; pwd"})]),
          ToolTurn([("exec_command", {"cmd": "cat out.txt"})]),
          TextTurn("The program printed: {last_output}")]


def agent_for(server: FakeOpenAIServer, model: str = "fake-model") -> SandboxAgent:
    client = AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0)
    return SandboxAgent(name="coder", instructions="Write and run code in the workspace.",
                        model=OpenAIResponsesModel(model=model, openai_client=client))


def run_config(client: SlotSandboxClient, **fields: Any) -> RunConfig:
    return RunConfig(sandbox=SandboxRunConfig(client=client, options=SlotSandboxClientOptions(), **fields))


async def test_runner_does_a_coding_task_in_one_slot(make_backend: Any) -> None:
    backend = await make_backend(slots_per_sandbox=4, max_sandboxes=1)
    client = SlotSandboxClient(backend)
    with FakeOpenAIServer(CODING, require_strict=False) as server:
        result = await Runner.run(agent_for(server), "Write hello.py printing 6*7, run it, show the output.",
                                  run_config=run_config(client))
        server.check()
    assert "Process exited with code 0" in result.final_output and "\n42\n" in result.final_output
    pwd = next(o["output"] for o in _tool_outputs(server) if "/data/slot_" in o["output"])
    assert "/data/slot_" in pwd
    calls = [r for r in server.requests if r["path"].endswith("/responses")]
    assert len(calls) == 4 and backend.get_status()["sandboxes"] == 1
    assert len(client.sessions) == 0  # the runner deleted its session: the slot is back


async def test_two_sessions_get_two_slots(make_backend: Any) -> None:
    backend = await make_backend(slots_per_sandbox=4, max_sandboxes=1)
    client = SlotSandboxClient(backend)
    script = {"a": [ToolTurn([("exec_command", {"cmd": "sleep 1; pwd"})]), TextTurn("{last_output}")],
              "b": [ToolTurn([("exec_command", {"cmd": "sleep 1; pwd"})]), TextTurn("{last_output}")]}
    with FakeOpenAIServer(script, require_strict=False) as server:
        held: list[int] = []

        async def watch() -> None:
            while True:
                held.append(len(client.sessions))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        try:
            a, b = await asyncio.gather(
                Runner.run(agent_for(server, "a"), "where are you?", run_config=run_config(client)),
                Runner.run(agent_for(server, "b"), "where are you?", run_config=run_config(client)))
        finally:
            watcher.cancel()
    dirs = {_slot_dir(a.final_output), _slot_dir(b.final_output)}
    assert len(dirs) == 2 and max(held) == 2


async def test_session_api_exec_files_timeout_and_paths(make_backend: Any) -> None:
    backend = await make_backend(slots_per_sandbox=4, max_sandboxes=1, output_limit=2000)
    client = SlotSandboxClient(backend)
    session = await client.create(options=SlotSandboxClientOptions())
    async with session:
        assert await session.running() and session.state.manifest.root.startswith("/data/slot_")
        r = await session.exec("echo out; echo err >&2; exit 3")
        assert (r.stdout, r.stderr, r.exit_code) == (b"out\n", b"err\n", 3)
        big = await session.exec("head -c 300000 /dev/zero | tr '\\0' x")
        assert big.stdout == b"x" * 300000  # far over the profile's output_limit, whole
        await session.write(Path("pkg/data.bin"), io.BytesIO(b"\x00\x01binary\xff"))
        assert (await session.read(Path("pkg/data.bin"))).read() == b"\x00\x01binary\xff"
        with pytest.raises(WorkspaceReadNotFoundError):
            await session.read(Path("missing.txt"))
        await session.exec("ln -s /etc link-out")
        for outside in ("../escape.txt", "/etc/passwd", "link-out/passwd"):
            with pytest.raises(InvalidManifestPathError):
                await session.read(Path(outside))
            with pytest.raises(InvalidManifestPathError):
                await session.write(Path(outside), io.BytesIO(b"x"))
        with pytest.raises(ExecTimeoutError):
            await session.exec("sleep 30", timeout=1)
        assert (await session.exec("echo alive")).stdout == b"alive\n"  # the shell survived
    assert not await session.running()
    await client.delete(session)
    assert len(client.sessions) == 0


async def test_exposed_port_is_a_preview(make_backend: Any) -> None:
    """``resolve_exposed_port`` gives the preview's endpoint with a single-use ticket:
    the URL opens once (a cookie, then the slot's server answers), a port not configured
    is refused, and the preview goes with the slot."""
    backend = await make_backend(max_sandboxes=1, network="none")  # the port only in the slot
    client = SlotSandboxClient(backend)
    session = await client.create(options=SlotSandboxClientOptions(exposed_ports=(8000,)))
    async with session:
        await session.exec("echo hello-preview > index.html; "
                           "nohup python3 -u -m http.server 8000 --bind 127.0.0.1 > srv.log 2>&1 &")
        for _ in range(100):
            if (await session.exec("grep -c Serving srv.log")).exit_code == 0:
                break
            await asyncio.sleep(0.1)
        endpoint = await session.resolve_exposed_port(8000)
        url = endpoint.url_for("http")
        assert endpoint.host == "127.0.0.1" and "hmt_ticket=" in endpoint.query, url
        status, headers, _ = await _get(endpoint.host, endpoint.port, "/?" + endpoint.query)
        assert status == 303, headers
        cookie = headers["set-cookie"].split(";")[0]
        assert (await _get(endpoint.host, endpoint.port, "/?" + endpoint.query))[0] == 403  # spent
        status, _, body = await _get(endpoint.host, endpoint.port, "/index.html", cookie)
        assert (status, body) == (200, "hello-preview\n")
        with pytest.raises(ExposedPortUnavailableError):
            await session.resolve_exposed_port(9000)  # not in exposed_ports
    await client.delete(session)
    with pytest.raises(ConnectionRefusedError):
        await _get(endpoint.host, endpoint.port, "/index.html", cookie)  # revoked with the slot


async def _get(host: str, port: int, path: str, cookie: str | None = None) -> tuple[int, dict[str, str], str]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write((f"GET {path} HTTP/1.1\r\nHost: {host}\r\n" + (f"Cookie: {cookie}\r\n" if cookie else "")
                  + "\r\n").encode())
    data = await asyncio.wait_for(reader.read(), 20)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    first, *rest = head.decode("latin-1").split("\r\n")
    return int(first.split()[1]), {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in rest)}, body.decode()


async def test_persist_hydrate_and_resume(make_backend: Any, tmp_path: Path) -> None:
    backend = await make_backend(slots_per_sandbox=4, max_sandboxes=1)
    client = SlotSandboxClient(backend)
    session = await client.create(options=SlotSandboxClientOptions(),
                                  snapshot=LocalSnapshotSpec(base_path=tmp_path))
    await session.start()
    await session.write(Path("notes/a.txt"), io.BytesIO(b"kept\n"))
    payload = client.serialize_session_state(session.state)
    # While the slot is held, resume reattaches to it: same slot, files in place.
    live = await client.resume(client.deserialize_session_state(dict(payload)))
    assert isinstance(live.state, SlotSandboxSessionState)
    assert live.state.slot_id == session.state.slot_id
    assert (await live.read(Path("notes/a.txt"))).read() == b"kept\n"
    # persist_workspace is a tar with workspace-relative members; hydrate restores it.
    archive = (await session.persist_workspace()).read()
    await session.exec("rm -rf notes")
    await session.hydrate_workspace(io.BytesIO(archive))
    assert (await session.read(Path("notes/a.txt"))).read() == b"kept\n"
    await session.stop()  # persists the workspace into the snapshot
    stopped = client.serialize_session_state(session.state)
    await session.shutdown()
    await client.delete(session)
    assert len(client.sessions) == 0
    # The slot is gone: resume takes a new slot and the SDK hydrates it from the snapshot.
    again = await client.resume(client.deserialize_session_state(dict(stopped)))
    async with again:
        assert (await again.read(Path("notes/a.txt"))).read() == b"kept\n"
        assert (await again.exec("ls -A")).stdout == b"notes\n"  # no transfer files left
    await client.aclose()


async def test_unknown_profile_is_a_config_error(make_backend: Any) -> None:
    client = SlotSandboxClient(await make_backend())
    with pytest.raises(ConfigError, match="nope"):
        await client.create(options=SlotSandboxClientOptions(profile="nope"))


def _tool_outputs(server: FakeOpenAIServer) -> list[dict[str, Any]]:
    last = [r for r in server.requests if r["path"].endswith("/responses")][-1]["body"]
    return [i for i in last["input"] if isinstance(i, dict) and i.get("type") == "function_call_output"]


def _slot_dir(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("/data/slot_"))


def test_benchmark_script_runs_small(tmp_path: Path) -> None:
    """benchmarks/agents_sdk.py: both clients over the local Modal control plane in one run."""
    import json
    import subprocess
    import sys

    out = tmp_path / "agents_sdk.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "agents_sdk.py"
    proc = subprocess.run([sys.executable, str(script), "--commands", "5", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["ours_slot_client"]["rpcs_per_command"] == 0
    assert res["sdk_modal_client"]["rpcs_by_method_per_command"]["TaskExecStart"] == 1
    assert res["sdk_modal_client"]["wrong_outputs"] == res["ours_slot_client"]["wrong_outputs"] == 0
    assert "SlotSandboxClient" in proc.stdout
