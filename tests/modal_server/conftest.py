"""Fixtures and helpers shared by the tests of the local Modal control plane.

Every test module in this folder (``test_modal_server_*.py``) gets the ``server``,
``app`` and ``api`` fixtures from here, and imports the helpers it needs
(``from .conftest import run``): pids by command line, a raw gRPC channel to the
server, and running one command in a sandbox through the SDK.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpclib.client
import modal
import pytest
from modal_proto import api_grpc, api_pb2

from hermes_modal_tool.testing.modal_server import LocalModalServer

# -- helpers ---------------------------------------------------------------------------


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (e.g. a server's state dir)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
    return found


@contextlib.asynccontextmanager
async def raw_channel(server: LocalModalServer) -> AsyncIterator[grpclib.client.Channel]:
    """A plain grpclib channel to the server, to see replies exactly as sent."""
    channel = grpclib.client.Channel("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
    try:
        yield channel
    finally:
        channel.close()


def token_metadata(server: LocalModalServer) -> dict[str, str]:
    return {"x-modal-token-id": server.token_id, "x-modal-token-secret": server.token_secret}


async def raw_sandbox_wait(server: LocalModalServer, sandbox_id: str) -> api_pb2.SandboxWaitResponse:
    async with raw_channel(server) as channel:
        return await api_grpc.ModalClientStub(channel).SandboxWait(
            api_pb2.SandboxWaitRequest(sandbox_id=sandbox_id, timeout=0),
            metadata=token_metadata(server))


async def run(sb: Any, *argv: str, **kwargs: Any) -> tuple[int, str, str]:
    p = await sb.exec.aio(*argv, **kwargs)
    out, err = await asyncio.gather(p.stdout.read.aio(), p.stderr.read.aio())
    return await p.wait.aio(), out, err


# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture
async def server(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[LocalModalServer]:
    """A started server the SDK points at; afterwards nothing of it may remain."""
    monkeypatch.setenv("OPENAI_API_KEY", "host-canary")  # must never reach a sandbox
    async with LocalModalServer() as srv:
        assert srv.isolation == "bwrap", "these tests need bubblewrap containers"
        for key, value in srv.env().items():
            monkeypatch.setenv(key, value)
        LocalModalServer.reset_env_client()
        try:
            yield srv
        finally:
            with contextlib.suppress(Exception):
                await (await modal.Client.from_env.aio()).close.aio()
            LocalModalServer.reset_env_client()
    assert srv.state_dir is not None and not srv.state_dir.exists()
    assert processes_mentioning(str(srv.state_dir)) == []


@pytest.fixture(params=[1, 2], ids=["v1", "v2"])
def api(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Which sandbox API the SDK uses (``MODAL_SANDBOX_V2``)."""
    monkeypatch.setenv("MODAL_SANDBOX_V2", "1" if request.param == 2 else "0")
    return request.param


@pytest.fixture
async def app(server: LocalModalServer) -> Any:
    return await modal.App.lookup.aio("modal-server-tests", create_if_missing=True)

