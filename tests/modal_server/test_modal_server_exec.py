"""The local Modal control plane, driven by the real ``modal`` SDK: running commands.

Execs (output, exit code, environment, filesystem), stdin (one long-lived write
stream, write and drain), sandboxes that run an entrypoint, and what a command
inside can reach (network, nested bubblewrap). Fixtures and helpers: ``conftest.py``.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from typing import Any

import modal
import pytest
from modal._utils.async_utils import synchronizer

from hermes_modal_tool.testing.modal_server import LocalModalServer

from .conftest import run

pytestmark = pytest.mark.timeout(60)

ECHO_LOOP = (
    "import sys\n"
    "for line in sys.stdin:\n"
    "    sys.stdout.write('echo:' + line)\n"
    "    sys.stdout.flush()\n"
)
NETWORK_PROBE = (
    "import socket, sys\n"
    "def connect(port):\n"
    "    s = socket.socket()\n"
    "    s.settimeout(2)\n"
    "    try:\n"
    "        s.connect(('127.0.0.1', port))\n"
    "        return 'ok'\n"
    "    except OSError as exc:\n"
    "        return type(exc).__name__\n"
    "    finally:\n"
    "        s.close()\n"
    "inside = socket.socket()\n"
    "inside.bind(('127.0.0.1', 0))\n"
    "inside.listen()\n"
    "print(connect(int(sys.argv[1])), connect(inside.getsockname()[1]))\n"
)
NESTED_BWRAP = (
    "import os, subprocess\n"
    "os.setgroups([]); os.setgid(200000); os.setuid(200000)\n"
    "argv = ['bwrap', '--unshare-user', '--unshare-pid', '--ro-bind', '/', '/',\n"
    "        '--proc', '/proc', '--dev', '/dev', 'sh', '-c', 'id -u; echo $$']\n"
    "r = subprocess.run(argv, capture_output=True, text=True)\n"
    "print(r.returncode, r.stdout.split(), r.stderr.strip())\n"
)


async def on_sdk_loop(coro: Any) -> Any:
    """Run a coroutine of the SDK's internals on the SDK's own event loop."""
    loop = synchronizer._get_loop(start=True)
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


class StdinFeed:
    """Chunks put here (on the test's loop) are yielded on the SDK's loop, for one
    long-lived ``TaskExecStdinWriteStream``; ``close()`` ends it (EOF)."""

    def __init__(self, queue: asyncio.Queue) -> None:
        self.queue = queue
        self.loop = synchronizer._get_loop(start=True)

    @classmethod
    async def create(cls) -> StdinFeed:
        async def make() -> asyncio.Queue:
            return asyncio.Queue()

        return cls(await on_sdk_loop(make()))

    def put(self, data: bytes) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, data)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    async def chunks(self) -> AsyncIterator[bytes]:
        while (item := await self.queue.get()) is not None:
            yield item


# -- execs ---------------------------------------------------------------------------------


async def test_exec_output_exit_code_env_and_filesystem(
        server: LocalModalServer, app: Any, api: int) -> None:
    sb = await modal.Sandbox.create.aio(app=app, env={"SANDBOX_VAR": "s"})
    script = ('echo out; echo err >&2; echo "$SANDBOX_VAR $EXEC_VAR $FROM_DICT $HOME";'
              'env | grep -c host-canary; touch /not-writable 2>/dev/null || echo ro; exit 3')
    code, out, err = await run(sb, "bash", "-c", script, env={"EXEC_VAR": "e"},
                               secrets=[modal.Secret.from_dict({"FROM_DICT": "d"})])
    assert (code, err) == (3, "err\n")
    assert out == "out\ns e d /root\n0\nro\n"
    # Writable directories are the sandbox's own and shared by its execs.
    assert (await run(sb, "bash", "-c", "echo hi > /workspace/f; echo x > /tmp/g"))[0] == 0
    assert (await run(sb, "cat", "/workspace/f", "/tmp/g"))[1] == "hi\nx\n"
    assert (server.sandboxes[sb.object_id].state_dir / "fs" / "workspace" / "f").read_text() == "hi\n"
    assert server.sandboxes[sb.object_id].exec_count == 3


async def test_long_lived_exec_over_one_stdin_stream_costs_no_rpc_per_message(
        server: LocalModalServer, app: Any) -> None:
    sb = await modal.Sandbox.create.aio(app=app)
    process = await sb.exec.aio("python3", "-u", "-c", ECHO_LOOP)
    task_id = await sb._get_task_id.aio()
    router = await sb._get_command_router_client.aio(task_id)
    exec_id = synchronizer._translate_in(process)._process_id
    feed = await StdinFeed.create()
    writer = asyncio.ensure_future(on_sdk_loop(
        router._exec_stdin_write_stream(task_id, exec_id, 0, feed.chunks())))
    lines = process.stdout.__aiter__()
    feed.put(b"warm up\n")
    assert await lines.__anext__() == "echo:warm up\n"
    rpcs, messages = dict(server.rpc_counts), server.stream_messages["TaskExecStdinWriteStream"]
    assert rpcs["TaskExecStdinWriteStream"] == 1 and rpcs["TaskExecStdioRead"] == 1
    for i in range(20):
        feed.put(f"line {i}\n".encode())
        assert await lines.__anext__() == f"echo:line {i}\n"
    assert dict(server.rpc_counts) == rpcs  # 20 round trips, not one RPC more
    assert server.stream_messages["TaskExecStdinWriteStream"] == messages + 20
    await asyncio.sleep(1.5)  # the stream stays open while idle
    feed.put(b"still there\n")
    assert await lines.__anext__() == "echo:still there\n"
    feed.close()  # End: stdin EOF, the loop exits
    await asyncio.wait_for(writer, 10)
    assert await process.wait.aio() == 0
    assert server.sandboxes[sb.object_id].live_execs == 0


async def test_stdin_write_and_drain(server: LocalModalServer, app: Any) -> None:
    sb = await modal.Sandbox.create.aio(app=app)
    process = await sb.exec.aio("python3", "-u", "-c", ECHO_LOOP)
    lines = process.stdout.__aiter__()
    process.stdin.write("one\n")
    await process.stdin.drain.aio()
    assert await lines.__anext__() == "echo:one\n"
    process.stdin.write(b"two\n")
    process.stdin.write_eof()
    await process.stdin.drain.aio()
    assert await lines.__anext__() == "echo:two\n"
    assert await process.wait.aio() == 0
    assert server.rpc_counts["TaskExecStdinWrite"] == 2

    process = await sb.exec.aio("python3", "-u", "-c", ECHO_LOOP)
    assert await process.poll.aio() is None
    assert await process._stdin_write_stream.aio(io.BytesIO(b"a\nb\n")) == 4  # then EOF
    assert await process.stdout.read.aio() == "echo:a\necho:b\n"
    assert await process.wait.aio() == 0 and await process.poll.aio() == 0
    task_id = await sb._get_task_id.aio()
    router = await sb._get_command_router_client.aio(task_id)
    exec_id = synchronizer._translate_in(process)._process_id
    status = await on_sdk_loop(router.exec_stdin_status(task_id, exec_id))
    assert (status.num_bytes_written, status.closed) == (4, True)


async def test_entrypoint_sandbox_runs_its_command_and_finishes(
        server: LocalModalServer, app: Any, api: int) -> None:
    sb = await modal.Sandbox.create.aio("bash", "-c", "read x; echo got $x; echo oops >&2; exit 3",
                                        app=app)
    sb.stdin.write("it\n")
    sb.stdin.write_eof()
    await sb.stdin.drain.aio()
    assert await sb.stdout.read.aio() == "got it\n"
    assert await sb.stderr.read.aio() == "oops\n"
    await sb.wait.aio()
    assert sb.returncode == 3
    record = server.sandboxes[sb.object_id]
    assert (record.status, record.result_reason, record.exit_code) == ("finished", "failure", 3)


# -- isolation -----------------------------------------------------------------------------


async def test_blocked_network_has_only_loopback(server: LocalModalServer, app: Any) -> None:
    port = server.url.rsplit(":", 1)[1]
    blocked = await modal.Sandbox.create.aio(app=app, block_network=True)
    open_ = await modal.Sandbox.create.aio(app=app)
    results = await asyncio.gather(run(blocked, "python3", "-c", NETWORK_PROBE, port),
                                   run(open_, "python3", "-c", NETWORK_PROBE, port))
    assert results[0][:2] == (0, "ConnectionRefusedError ok\n"), results
    assert results[1][:2] == (0, "ok ok\n"), results


async def test_nested_bwrap_works_as_an_unprivileged_uid(server: LocalModalServer, app: Any) -> None:
    sb = await modal.Sandbox.create.aio(app=app)
    code, out, _ = await run(sb, "bash", "-c", "command -v bwrap; ls -ld /run/modal-local")
    assert code == 0 and out.startswith("/run/modal-local/bin/bwrap\n")
    code, out, err = await run(sb, "python3", "-c", NESTED_BWRAP)
    assert (code, out) == (0, "0 ['200000', '2'] \n"), err  # pid 2 in its own PID namespace
