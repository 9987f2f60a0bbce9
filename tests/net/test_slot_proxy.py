"""``egress.proxy: true`` on the local driver: a slot's HTTP(S) goes only through the
agent's forward proxy (agent/net/proxy.py, in the sandbox's router namespace), which
applies the slot's allow/deny lists; every direct connection is refused by the slot's
nftables table. Against the fake internet (the router attached with ``upstream: none``).
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest
from support import SMALL, bash, settle

from hermes_modal_tool import SandboxConfig
from hermes_modal_tool.agent.net import proxy
from hermes_modal_tool.agent.net.policy import EgressPolicy
from hermes_modal_tool.testing import fakenet as fn

#: Run in the slot; prints one JSON object of verdicts.
PROBE = r"""
import json, os, socket, time, urllib.error, urllib.request
out = {"env": [os.environ.get(k) for k in ("HTTP_PROXY", "https_proxy")]}
def get(url):
    try:
        return urllib.request.urlopen(url, timeout=5).read().decode().strip()
    except urllib.error.HTTPError as e:
        return "%d %s" % (e.code, e.read().decode().strip())
def tunnel(target):
    host, port = os.environ["HTTPS_PROXY"][7:].rsplit(":", 1)
    with socket.create_connection((host, int(port)), 5) as s:
        s.sendall(b"CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target.encode(), target.encode()))
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(1)
            if not chunk:
                break
            head += chunk
        status = head.split(b"\r\n")[0].decode()
        if " 200 " not in status:
            return status
        s.sendall(b"hi")
        return status + " " + s.recv(2).decode()
def direct(address, port):
    t = time.time()
    try:
        socket.create_connection((address, port), 5).close()
        return "ok"
    except OSError as e:
        return "%s %.2f" % (type(e).__name__, time.time() - t)
out["get"] = get("http://www.example.test/")
out["get_denied"] = get("http://api.example.test/")
out["connect"] = tunnel("www.example.test:7")
out["connect_private"] = tunnel("%s:7" % PRIVATE)
out["direct"] = direct(WWW, 7)
print(json.dumps(out))
""".replace("PRIVATE", repr(fn.PRIVATE)).replace("WWW", repr(fn.WWW))


@pytest.fixture
async def proxied(make_backend: Any, fakenet: fn.FakeInternet) -> Any:
    config = SandboxConfig(name="proxied", **{**SMALL, "max_sandboxes": 1}, network="egress",
                           egress={"allow": ["www.example.test", "private.example.test"],
                                   "dns": fn.DNS, "upstream": "none", "proxy": True})
    backend = await make_backend(config=config)
    slot = await backend.acquire("proxy-first")
    [sb] = [s for s in backend._pools["proxied"]._sandboxes.values() if not s.dead]
    fakenet.attach(str(sb.info["network_router"]), default_route=True, standins=True, other_ifaces="hs")
    yield backend, slot


async def test_proxy_only_egress(proxied: Any) -> None:
    backend, slot = proxied
    await backend.execute_batch([(slot, "write_file", {"path": "probe.py", "content": PROBE})])
    r = await bash(backend, slot, "python3 probe.py")
    assert r.success, r.output
    out = json.loads(r.output)
    assert out["env"] == ["http://10.253.0.1:3128"] * 2, out
    # Through the proxy: an allowed name, by GET and by CONNECT (the positive controls).
    assert out["get"] == f"fakenet {fn.WWW} www.example.test", out
    assert out["connect"] == "HTTP/1.1 200 Connection established hi", out
    # A name not allowed, and a private address (default-denied), refused by the proxy.
    assert out["get_denied"].startswith("403 ") and "api.example.test" in out["get_denied"], out
    assert out["connect_private"] == "HTTP/1.1 403 Forbidden", out
    # The same address as the allowed name's, directly: refused at once by the table.
    verdict = out["direct"].split()
    assert verdict[0] == "ConnectionRefusedError" and float(verdict[-1]) < 0.5, out
    status = backend.get_status()
    assert status["network_refused"] == 0
    await backend.release(slot)
    # The tenant's refusals, counted as its slot is released: 2 by the proxy (and the
    # name's NXDOMAIN), 1 by the table.
    assert await settle(lambda: backend.get_status()["network_refused"] >= 3, 10), backend.get_status()


@pytest.mark.parametrize(("head", "why"), [
    (b"CONNECT www.example.test HTTP/1.1\r\n\r\n", "host:port"),
    (b"GET /relative HTTP/1.1\r\nHost: x\r\n\r\n", "absolute http://"),
    (b"GET https://www.example.test/ HTTP/1.1\r\n\r\n", "absolute http://"),
    (b"CONNECT www.example.test:99999 HTTP/1.1\r\n\r\n", "bad target"),
    (b"garbage\r\n\r\n", "malformed"),
])
def test_bad_proxy_requests_are_refused_with_the_reason(head: bytes, why: str) -> None:
    with pytest.raises(proxy.Refused, match=why):
        proxy.parse_head(head)


def test_absolute_uri_is_sent_on_in_origin_form_without_proxy_headers() -> None:
    method, host, port, forward = proxy.parse_head(
        b"GET http://www.example.test:8080/a?b=1 HTTP/1.1\r\nHost: www.example.test:8080\r\n"
        b"Proxy-Authorization: Basic eA==\r\nProxy-Connection: keep-alive\r\n\r\n")
    assert (method, host, port) == ("GET", "www.example.test", 8080)
    assert forward == b"GET /a?b=1 HTTP/1.1\r\nHost: www.example.test:8080\r\n\r\n"


def test_one_slot_cannot_take_every_proxy_connection() -> None:
    """On 127.0.0.1 (the test's own loopback): a slot's 65th open connection is closed at
    once, another slot's is served, and the first slot is served again once one ends."""
    slot = (EgressPolicy(["www.example.test"]), None)
    server = proxy.ForwardProxy(lambda peer: slot, bind=("127.0.0.1", 0)).start()
    port = server._sock.getsockname()[1]

    def answer(source: str) -> bytes:
        with socket.create_connection(("127.0.0.1", port), 5, source_address=(source, 0)) as s:
            try:
                s.sendall(b"GET /relative HTTP/1.1\r\n\r\n")  # refused by the proxy: a 403
                return s.recv(12)
            except ConnectionResetError:  # closed with the request unread
                return b""

    held = [socket.create_connection(("127.0.0.1", port), 5) for _ in range(proxy.MAX_PER_SLOT)]
    try:
        assert answer("127.0.0.2") == b"HTTP/1.1 403"  # another slot: served
        assert answer("127.0.0.1") == b""  # this one's 65th: closed
        held.pop().close()
        assert settle_sync(lambda: answer("127.0.0.1") == b"HTTP/1.1 403")
    finally:
        for s in held:
            s.close()
        server.close()


def settle_sync(check: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False
