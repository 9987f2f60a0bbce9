"""Previews (``backend.expose``), end to end on the local driver: a server runs in a real
slot (``network: egress`` and ``none``: its port exists only in the slot's network
namespace), a client on the host talks to the preview's URL.

Verdicts are read on both sides: what the client got, and what the slot's server saw
(it logs every connection it accepted and every request's ``Authorization`` header).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import socket
from typing import Any

import pytest
from support import SMALL, bash, eventually

from hermes_modal_tool import SandboxConfig
from hermes_modal_tool.errors import UsageError

#: Run in the slot: ``python3 srv.py PORT NAME``. Logs ``conn`` per accepted connection and
#: ``auth <header>`` per request to ``conns.log``; answers ``NAME <path> cookie=<Cookie>``
#: (Connection: close), or a WebSocket upgrade, then echoes one text frame back.
SERVER = r"""
import base64, hashlib, socket, sys, threading
port, name = int(sys.argv[1]), sys.argv[2]
log = open("conns.log", "a", buffering=1)
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port)); srv.listen(16)
open("ready", "w").close()
def serve(c):
    f = c.makefile("rb")
    lines = []
    while True:
        line = f.readline()
        if line in (b"\r\n", b""): break
        lines.append(line.decode().rstrip("\r\n"))
    hdr = {l.split(":", 1)[0].lower(): l.split(":", 1)[1].strip() for l in lines[1:]}
    log.write("auth %s\n" % hdr.get("authorization", "-"))
    if hdr.get("upgrade", "").lower() == "websocket" and "upgrade" in hdr.get("connection", "").lower():
        acc = base64.b64encode(hashlib.sha1((hdr["sec-websocket-key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
        c.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   "Sec-WebSocket-Accept: %s\r\n\r\n" % acc).encode())
        b0, b1 = f.read(2)
        mask = f.read(4); data = bytearray(f.read(b1 & 127))
        for i in range(len(data)): data[i] ^= mask[i % 4]
        c.sendall(bytes([0x81, len(data) + 5]) + b"echo:" + bytes(data))
    elif lines[0].split()[1].startswith("/big/"):  # /big/N: N MiB, then "sent" in the log
        n = int(lines[0].split()[1][5:]) << 20
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % n)
        block = bytes(range(256)) * 4096
        for _ in range(n // len(block)): c.sendall(block)
        log.write("sent\n")
    else:
        body = ("%s %s cookie=%s" % (name, lines[0].split()[1], hdr.get("cookie", "-"))).encode()
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    c.close()
while True:
    c, _ = srv.accept()
    log.write("conn\n")
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


async def start_server(backend: Any, slot: Any, name: str, port: int = 8000) -> None:
    await backend.execute_batch([(slot, "write_file", {"path": "srv.py", "content": SERVER})])
    r = await bash(backend, slot, f"rm -f ready conns.log; python3 srv.py {port} {name} > srv.out 2>&1",
                   background=True)
    assert r.success, r.output
    ready = await eventually(lambda: bash(backend, slot, "test -e ready && echo yes || cat srv.out"),
                             lambda r: r.output.strip() == "yes", 15)
    assert ready.output.strip() == "yes", ready.output


async def seen(backend: Any, slot: Any) -> list[str]:
    """What the slot's server logged."""
    r = await bash(backend, slot, "cat conns.log 2>/dev/null; true")
    return [line for line in r.output.split("\n") if line]


async def http(url: str, path: str = "/", headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    """One HTTP/1.1 GET of ``url``'s host and ``path``; ``(status, headers, body)``."""
    host, port = url.split("//")[1].rstrip("/").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}",
                 *(f"{k}: {v}" for k, v in (headers or {}).items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = await asyncio.wait_for(reader.read(), 20)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *rest = head.decode("latin-1").split("\r\n")
    return int(status_line.split()[1]), {k.lower(): v.strip() for k, _, v in
                                         (line.partition(":") for line in rest)}, body.decode()


@pytest.fixture(params=["egress", "none"])
async def two(request: Any, make_backend: Any) -> Any:
    """A backend of one sandbox of two slots in network mode ``egress`` or ``none``,
    a server on port 8000 in each (answering ``A`` and ``B``)."""
    if request.param == "egress" and os.geteuid() != 0:
        pytest.skip("network: egress needs root here (namespaces, veth pairs)")
    extra = {"egress": {"dns": "127.0.0.1", "upstream": "none"}} if request.param == "egress" else {}
    backend = await make_backend(config=SandboxConfig(
        name="prev", **{**SMALL, "max_sandboxes": 1}, network=request.param, **extra))
    a, b = await backend.acquire("prev-a"), await backend.acquire("prev-b")
    await asyncio.gather(start_server(backend, a, "A"), start_server(backend, b, "B"))
    return backend, a, b


async def test_token_opens_and_nothing_else_reaches_the_slot(two: Any) -> None:
    backend, a, b = two
    pa, pb = await backend.expose(a, 8000), await backend.expose(b, 8000)
    assert pa.url.startswith("http://127.0.0.1:") and pa.token != pb.token
    # Refused without the token, with a wrong one, with B's token, and with B's cookie.
    assert (await http(pa.url))[0] == 401
    assert (await http(pa.url, headers={"Authorization": "Bearer nope"}))[0] == 403
    assert (await http(pa.url, headers=pb.headers))[0] == 403
    assert await seen(backend, a) == []  # the slot saw no connection at all
    # The control: the same request with the token reaches the slot's server (once).
    status, _, body = await http(pa.url, "/x?y=1", headers=pa.headers)
    assert (status, body) == (200, "A /x?y=1 cookie=-")
    assert await seen(backend, a) == ["conn", "auth -"]  # the token was not passed on
    status, _, body = await http(pb.url, headers=pb.headers)
    assert (status, body) == (200, "B / cookie=-")


async def test_ticket_once_then_cookie(two: Any) -> None:
    backend, a, _ = two
    preview = await backend.expose(a, 8000)
    ticket_url = preview.ticket_url("/page?q=1")
    path = "/" + ticket_url.split("/", 3)[3]
    status, headers, _ = await http(preview.url, path)
    assert status == 303 and headers["location"] == "/page?q=1", headers
    cookie = headers["set-cookie"].split(";")[0]
    assert (await http(preview.url, path))[0] == 403  # the ticket is spent
    assert await seen(backend, a) == []
    status, _, body = await http(preview.url, "/page?q=1", headers={"Cookie": f"{cookie}; app=1"})
    assert (status, body) == (200, "A /page?q=1 cookie=app=1")  # the preview's cookie kept back


async def test_websocket_round_trip(two: Any) -> None:
    backend, a, _ = two
    preview = await backend.expose(a, 8000)
    host, port = preview.url.split("//")[1].rstrip("/").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((f"GET /ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                  f"Authorization: Bearer {preview.token}\r\n\r\n").encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
    accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
    assert head.startswith(b"HTTP/1.1 101") and accept in head, head
    mask, payload = os.urandom(4), b"hello"
    writer.write(bytes([0x81, 0x80 | len(payload)]) + mask + bytes(c ^ mask[i % 4] for i, c in enumerate(payload)))
    frame = await asyncio.wait_for(reader.readexactly(2 + 10), 20)
    assert frame == bytes([0x81, 10]) + b"echo:hello"
    writer.close()


async def open_websocket(preview: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A WebSocket through ``preview``, upgraded (the slot's server then waits for a frame)."""
    host, port = preview.url.split("//")[1].rstrip("/").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write((f"GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: "
                  f"{base64.b64encode(os.urandom(16)).decode()}\r\n"
                  f"Authorization: Bearer {preview.token}\r\n\r\n").encode())
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)).startswith(b"HTTP/1.1 101")
    return reader, writer


async def test_unexpose_release_and_stop_revoke(two: Any) -> None:
    backend, a, b = two
    pa, pb = await backend.expose(a, 8000), await backend.expose(b, 8000)
    reader, writer = await open_websocket(pb)  # open while B's preview is revoked
    assert (await http(pa.url, headers=pa.headers))[0] == 200  # the controls
    assert (await http(pb.url, headers=pb.headers))[0] == 200
    assert await backend.unexpose(b, 8000) == 1
    assert pb.revoked and await asyncio.wait_for(reader.read(), 20) == b""  # closed, B still runs
    writer.close()
    with pytest.raises(ConnectionRefusedError):
        await http(pb.url, headers=pb.headers)  # the listener is gone
    with pytest.raises(UsageError):
        pb.ticket_url()
    assert (await http(pa.url, headers=pa.headers))[0] == 200  # A's preview is untouched
    await backend.release(a)
    with pytest.raises(ConnectionRefusedError):
        await http(pa.url, headers=pa.headers)
    pc = await backend.expose(b, 8000)
    assert (await http(pc.url, headers=pc.headers))[0] == 200
    await backend.stop()
    with pytest.raises(ConnectionRefusedError):
        await http(pc.url, headers=pc.headers)


async def test_a_slow_client_holds_bytes_in_the_slot_not_the_agent(two: Any) -> None:
    """A client that reads nothing: the slot's server stays blocked in ``sendall`` (the
    bytes wait in its socket; the agent reads only what the host asks for), the other
    slot's calls go on meanwhile; once read, every byte arrives, in order."""
    backend, a, b = two
    preview = await backend.expose(a, 8000)
    host, port = preview.url.split("//")[1].rstrip("/").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET /big/64 HTTP/1.1\r\nAuthorization: Bearer {preview.token}\r\n\r\n".encode())
    await asyncio.sleep(1.5)  # the client reads nothing
    assert (await bash(backend, b, "echo other")).output.strip() == "other"
    assert await seen(backend, a) == ["conn", "auth -"]  # no "sent": the server still waits
    data = await asyncio.wait_for(reader.read(), 60)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and len(body) == 64 << 20
    assert body == bytes(range(256)) * (len(body) // 256)
    assert await seen(backend, a) == ["conn", "auth -", "sent"]  # the control


async def test_host_mode(make_backend: Any) -> None:
    """``network: host``: the same path (the agent's socket is in the host's namespace,
    which the slot shares); a port the test picked free on the host."""
    backend = await make_backend(config=SandboxConfig(name="prevhost", **SMALL, network="host"))
    slot = await backend.acquire("prev-host")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    await start_server(backend, slot, "H", port)
    preview = await backend.expose(slot, port)
    assert (await http(preview.url))[0] == 401
    assert await seen(backend, slot) == []
    status, _, body = await http(preview.url, headers=preview.headers)
    assert (status, body) == (200, "H / cookie=-")
    assert await seen(backend, slot) == ["conn", "auth -"]


async def test_bad_arguments(two: Any) -> None:
    backend, a, _ = two
    with pytest.raises(UsageError, match="port must be"):
        await backend.expose(a, 0)
    with pytest.raises(UsageError, match="'localhost'"):
        await backend.expose(a, 8000, host="localhost")
    preview = await backend.expose(a, 8001)  # nothing listens there: 502, no hang
    status, _, body = await http(preview.url, headers=preview.headers)
    assert status == 502 and "nothing listens on port 8001" in body, body
