"""The fake internet itself: every service answers inside it, and nothing leaks out.

Later network tests (egress policy, resolver, pip through a slot) stand on these
answers, so each service is checked here with a real client: curl, glibc's resolver,
pip, Python's ssl against the test CA, dnslib over TCP.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from dnslib import DNSRecord

from hermes_modal_tool.testing import fakenet as fn
from hermes_modal_tool.testing._fakenet_files import DEMO_MESSAGE, DEMO_PROJECT

from .conftest import require_root


def test_services_answer_inside_the_namespace(fakenet: fn.FakeInternet, tmp_path: Path) -> None:
    ns = fakenet.netns()
    # HTTP, through curl: the answer names the address that served it.
    r = ns.run("curl", "-sS", "--max-time", "5", f"http://{fn.API}/")
    assert r.returncode == 0 and r.stdout == f"fakenet {fn.API} {fn.API}\n", r
    with ns.enter():
        # HTTPS with the test CA, by name; the same handshake without it fails.
        trusting = ssl.create_default_context(cafile=str(fakenet.ca))
        with fn.connect(fn.WWW, 443) as raw, trusting.wrap_socket(raw, server_hostname="www.example.test") as tls:
            tls.sendall(b"GET / HTTP/1.0\r\nHost: www.example.test\r\n\r\n")
            reply = b"".join(iter(lambda: tls.recv(4096), b""))
            assert reply.endswith(b"\r\n\r\nfakenet 198.51.100.10 www.example.test\n"), reply
        with fn.connect(fn.WWW, 443) as raw, pytest.raises(ssl.SSLCertVerificationError):
            ssl.create_default_context().wrap_socket(raw, server_hostname="www.example.test")
        # Raw TCP: echo, and the byte source the benchmark uses.
        with fn.connect(fn.OTHER, 7) as s:
            s.sendall(b"ping\n")
            assert s.recv(16) == b"ping\n"
        with fn.connect(fn.WWW, 19) as s:
            s.sendall(b"3000000\n")
            got = b"".join(iter(lambda: s.recv(1 << 16), b""))
            assert got == bytes(3_000_000)
        # DNS over TCP (dnslib's client); UDP is what glibc uses below.
        answer = DNSRecord.parse(DNSRecord.question("pypi.example.test").send(fn.DNS, 53, tcp=True, timeout=5))
        assert [str(rr.rdata) for rr in answer.rr] == [fn.PYPI]
    # glibc's resolver pointed at the fake DNS: a known name resolves, another does not.
    r = ns.run("getent", "ahostsv4", "www.example.test", nameserver=fn.DNS)
    assert r.returncode == 0 and r.stdout.split()[0] == fn.WWW, r
    r = ns.run("getent", "ahostsv4", "nosuch.example.test", nameserver=fn.DNS)
    assert r.returncode == 2 and r.stdout == "", r
    # pip, by name through that DNS and HTTPS with the test CA, from the local index.
    target = tmp_path / "site"
    # (pip trusts the system's store through truststore, which reads SSL_CERT_FILE; no
    # pip.conf of this machine: its find-links are not the fake internet.)
    env = {**os.environ, "SSL_CERT_FILE": str(fakenet.ca), "PIP_CONFIG_FILE": os.devnull}
    r = ns.run(sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir", "--disable-pip-version-check",
               "--retries", "0", "--index-url", "https://pypi.example.test/simple/", "--target", str(target),
               DEMO_PROJECT, nameserver=fn.DNS, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-c", "import hmt_fakenet_demo as m; print(m.MESSAGE)"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(target)})
    assert r.stdout.strip() == DEMO_MESSAGE


def test_nothing_routes_out(fakenet: fn.FakeInternet) -> None:
    """From a client namespace and from the fake internet itself, a real address (this
    host's default gateway and its own address) is unreachable at once, while the fake
    internet answers; and a route out planted into a client is caught by the check."""
    route = json.loads(subprocess.run(["ip", "-j", "-4", "route", "show", "default"], capture_output=True,
                                      text=True, check=True).stdout or "[]")
    real = [r["gateway"] for r in route if "gateway" in r]
    real += [_own_address(real[0])] if real else []
    if not real:
        pytest.skip("this host has no default route: no real address to try")
    ns = fakenet.netns()
    for where in (ns.path, fakenet.path):
        with fn.enter_netns(where):
            if where == ns.path:
                fn.connect(fn.WWW, 80).close()  # the positive control
            for address in real:
                with pytest.raises(OSError) as err:
                    fn.connect(address, 80, timeout=2).close()
                assert err.value.errno == errno.ENETUNREACH, (where, address, err.value)
    fakenet.check_routes(ns.path, allow_default=False, only=ns.ifname)
    r = ns.run("ip", "route", "add", "192.0.2.0/24", "via", fn.GATEWAY)
    assert r.returncode == 0, r.stderr
    with pytest.raises(fn.FakenetError, match="192.0.2.0/24"):
        fakenet.check_routes(ns.path, allow_default=False, only=None)


def test_stop_removes_everything(tmp_path: Path) -> None:
    require_root()
    net = fn.FakeInternet(tmp_path).start()
    try:
        ns = net.netns()
        pids = [ns.pid, int(net.path.split("/")[2])]
        inodes = {os.stat(f"/proc/{pid}/ns/net").st_ino for pid in pids}
        with ns.enter():
            fn.connect(fn.WWW, 7).close()
        assert len(inodes) == 2 and os.stat("/proc/self/ns/net").st_ino not in inodes
    finally:
        net.stop()
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    alive = subprocess.run(["lsns", "-t", "net", "-J", "-o", "NS"], capture_output=True, text=True, check=True)
    assert not inodes & {int(n["ns"]) for n in json.loads(alive.stdout)["namespaces"]}
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert " fnh" not in links and " fnc" not in links


def _own_address(gateway: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((gateway, 9))  # a UDP connect sends nothing: it picks the source address
        return str(s.getsockname()[0])
