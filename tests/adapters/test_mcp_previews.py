"""The MCP server's ``expose_port`` / ``unexpose_port``, through the official MCP client.

The server runs as its own process (``hermes-modal-tool mcp``) on local bubblewrap
sandboxes; ``python3 -m http.server`` runs in the session's slot. Verdicts on both
sides: what the host's HTTP client got, and what the slot's server logged (a refused
request never reaches it).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import httpx2
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from test_mcp import COMMAND, HttpServer, _env, http_session, start_http_server, text

from hermes_modal_tool.mcp_server import MCP_TOOL_SPECS

SERVE = "echo hello-from-the-slot > index.html; exec python3 -m http.server {port} --bind 127.0.0.1 > srv.log 2>&1"


@contextlib.asynccontextmanager
async def mcp_http(tmp_path: Path) -> AsyncIterator[HttpServer]:
    """A ``hermes-modal-tool mcp --transport http`` of this test's own (default idle lifetime)."""
    proc, lines = start_http_server(tmp_path)
    try:
        url = re.search(r"serving (http://127\.0\.0\.1:\d+/mcp)", lines[0])
        token = re.search(r"'Authorization: Bearer (\S+)'", lines[1])
        assert url and token, lines
        yield HttpServer(url.group(1), token.group(1), Path())
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def listens(url: str) -> bool:
    """Whether a TCP connection to ``url``'s host and port is accepted."""
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=5).close()
    except ConnectionRefusedError:
        return False
    return True


async def served_paths(session: ClientSession) -> str:
    """The request lines the slot's http.server logged."""
    return text(await session.call_tool("bash", {"command": "cat srv.log"}))


async def expose_and_wait(session: ClientSession, port: int, path: str) -> dict[str, Any]:
    """expose_port, then poll with the token until the slot's server answers (502 before)."""
    r = await session.call_tool("expose_port", {"port": port, "path": path})
    assert not r.is_error, text(r)
    found = r.structured_content
    assert found["ticket_url"] in text(r) and found["token"] in text(r) and found["url"] in text(r)
    async with httpx.AsyncClient(timeout=10) as client:
        deadline = time.monotonic() + 20
        while (await client.get(found["url"], headers=found["headers"])).status_code == 502:
            assert time.monotonic() < deadline, "the slot's server never answered through the preview"
            await asyncio.sleep(0.2)
    return found


async def test_expose_port_ticket_cookie_token_401_and_revoked_at_session_end(tmp_path: Path) -> None:
    """A person's ticket URL (then its cookie) and a program's token header reach the
    slot's server; no credentials is 401 and reaches nothing; ``unexpose_port`` and the
    session's end close the listener; a client without a session is told it needs one."""
    async with mcp_http(tmp_path) as server:
        async with http_session(server) as session:
            listed = [t.name for t in (await session.list_tools()).tools]
            assert listed[-2:] == ["expose_port", "unexpose_port"] and listed == list(MCP_TOOL_SPECS)
            r = await session.call_tool("bash", {"command": SERVE.format(port=8000), "background": True})
            assert not r.is_error, text(r)
            found = await expose_and_wait(session, 8000, "/index.html")
            assert found["url"].startswith("http://127.0.0.1:") and found["url"].endswith("/index.html")
            assert found["headers"] == {"Authorization": f"Bearer {found['token']}"}
            async with httpx.AsyncClient(timeout=10) as browser:  # keeps cookies, follows no redirect
                traded = await browser.get(found["ticket_url"])
                assert traded.status_code == 303 and traded.headers["location"] == "/index.html", traded
                page = await browser.get(found["url"])  # the cookie alone now
                assert page.status_code == 200 and page.text.strip() == "hello-from-the-slot"
            async with httpx.AsyncClient(timeout=10) as other:
                spent = await other.get(found["ticket_url"])  # a ticket works once
                assert spent.status_code == 403
            base = found["url"].rsplit("/", 1)[0]
            async with httpx.AsyncClient(timeout=10) as program:
                refused = await program.get(base + "/no-credentials")
                assert refused.status_code == 401 and "no-credentials" not in await served_paths(session)
                ok = await program.get(base + "/with-token", headers=found["headers"])  # positive control
                assert ok.status_code == 404 and "GET /with-token" in await served_paths(session)
            again = await session.call_tool("expose_port", {"port": 8000})  # same preview, new ticket
            assert again.structured_content["token"] == found["token"]
            assert again.structured_content["ticket_url"] != found["ticket_url"]
            assert listens(found["url"])
            other = await session.call_tool("expose_port", {"port": 9001})  # nothing listens: fine
            assert listens(other.structured_content["url"]), text(other)
            r = await session.call_tool("unexpose_port", {"port": 8000})
            assert not r.is_error and r.structured_content == {"revoked": [8000]}, text(r)
            assert not listens(found["url"])
            r = await session.call_tool("unexpose_port", {"port": 8000})
            assert r.structured_content == {"revoked": []} and "8000 was not exposed" in text(r)
            r = await session.call_tool("unexpose_port", {})  # all: 9001 was left
            assert r.structured_content == {"revoked": [9001]}, text(r)
            assert not listens(other.structured_content["url"])
            last = await expose_and_wait(session, 8000, "/")
            assert last["token"] != found["token"] and listens(last["url"])
        deadline = time.monotonic() + 20  # the session ended: its slot is released, previews too
        while listens(last["url"]):
            assert time.monotonic() < deadline, "the preview outlived its MCP session"
            await asyncio.sleep(0.2)
        # A 2026-07-28 client without a session: each request gets a slot released once
        # it is answered, so a preview would be dead on arrival; it is refused instead.
        client = httpx2.AsyncClient(headers=server.headers, timeout=httpx2.Timeout(30, read=120))
        async with client, streamable_http_client(server.url, http_client=client) as (read, write), \
                ClientSession(read, write) as sessionless:
            await sessionless.discover()
            ran = await sessionless.call_tool("bash", {"command": "echo ran"})  # positive control
            assert text(ran) == "ran\n[exit code 0]", text(ran)
            r = await sessionless.call_tool("expose_port", {"port": 8000})
            assert r.is_error and "expose_port needs an MCP session" in text(r), text(r)


BAD = [({"port": 0}, "got 0"), ({"port": 65536}, "got 65536"), ({"port": "8000"}, "got '8000'"),
       ({"port": 8000.5}, "got 8000.5"), ({"port": True}, "got True"), ({}, "port: Field required"),
       ({"port": 8000, "path": "index.html"}, "got 'index.html'"), ({"port": 8000, "host": "0.0.0.0"}, "host")]


async def test_bad_expose_port_arguments_are_tool_errors_naming_the_value() -> None:
    """Over stdio (``--preview-host 127.0.0.2``): each bad argument is a tool error naming
    it and the value; the session goes on (a good call after them succeeds, on the
    preview host given: the positive control). A preview host that is not an IP address
    stops the command with its name."""
    bad_host = await asyncio.to_thread(
        subprocess.run, [COMMAND, "mcp", "--preview-host", "localhost"], env=_env(), capture_output=True,
        text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert bad_host.returncode != 0 and "--preview-host" in bad_host.stderr and "'localhost'" in bad_host.stderr
    params = StdioServerParameters(command=COMMAND, args=["mcp", "--preview-host", "127.0.0.2"], env=_env())
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        for args, named in BAD:
            r = await session.call_tool("expose_port", args)
            assert r.is_error and "invalid arguments for expose_port" in text(r) and named in text(r), (
                args, text(r))
        bad = await session.call_tool("unexpose_port", {"port": -1})
        assert bad.is_error and "got -1" in text(bad), text(bad)
        ok = await session.call_tool("expose_port", {"port": 8000})
        assert not ok.is_error and ok.structured_content["url"].startswith("http://127.0.0.2:"), text(ok)
        assert listens(ok.structured_content["url"])
