"""The fake internet's server process: run inside a fresh network namespace.

``python -m hermes_modal_tool.testing._fakenet_serve CONFIG.json`` (started by
:class:`hermes_modal_tool.testing.fakenet.FakeInternet` under ``unshare --net``)
brings up ``lo`` holding the fake internet's addresses (one ``/32`` each; no default
route), then serves on every address:

- HTTP on 80: ``/`` answers ``fakenet <local address> <Host header>``; ``/simple/``
  and ``/packages/`` are the PEP 503 index of the config's ``index`` directory;
- HTTPS on 443: the same, with the config's certificate (signed by the test CA);
- TCP echo on 7; a byte source on 19 (send ``N\\n``, receive ``N`` zero bytes);
- DNS on 53 of the config's ``dns`` address (UDP and TCP, ``dnslib``): ``A`` records of the config's ``zone``,
  NXDOMAIN for other names.

It prints ``ready`` on stdout once everything is bound, and exits when its stdin
reaches end of file (the test process closed it or died) or on SIGTERM; the kernel
kills it too when its parent dies (``PR_SET_PDEATHSIG``). The namespace dies with it.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import signal
import socket
import socketserver
import ssl
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, stdout=subprocess.DEVNULL)


def _setup_interfaces(addresses: list[str]) -> None:
    # On lo: kernels without the dummy driver (this VM's) have it too.
    _ip("link", "set", "lo", "up")
    for addr in addresses:
        _ip("addr", "add", f"{addr}/32", "dev", "lo")


class _Web(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:  # noqa: N802
        if self.path.startswith(("/simple", "/packages")):
            super().do_GET()
            return
        body = f"fakenet {self.connection.getsockname()[0]} {self.headers.get('Host', '')}\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while True:
            data = self.request.recv(65536)
            if not data:
                return
            self.request.sendall(data)


class _Source(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        line = self.rfile.readline(32)
        try:
            left = int(line)
        except ValueError:
            return
        # sendfile from a file of zeros: the kernel copies, so the source outruns the
        # egress paths it measures (a Python send loop capped them all alike).
        with open(self.server.zeros, "rb") as zeros:  # type: ignore[attr-defined]
            size = os.fstat(zeros.fileno()).st_size
            while left > 0:
                sent = os.sendfile(self.request.fileno(), zeros.fileno(), 0, min(left, size))
                if sent <= 0:
                    return
                left -= sent


class _TCP(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


class _HTTP(ThreadingHTTPServer):
    daemon_threads = True


def _dns_servers(zone: dict[str, list[str]], address: str) -> list[Any]:
    from dnslib import QTYPE, RCODE, RR, A
    from dnslib.server import BaseResolver, DNSLogger, DNSServer

    names = {n.lower().rstrip(".") + ".": addrs for n, addrs in zone.items()}

    class Zone(BaseResolver):  # type: ignore[misc]
        def resolve(self, request: Any, handler: Any) -> Any:
            reply = request.reply()
            qname = str(request.q.qname).lower()
            if qname not in names:
                reply.header.rcode = RCODE.NXDOMAIN
            elif request.q.qtype in (QTYPE.A, QTYPE.ANY):
                for addr in names[qname]:
                    reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(addr), ttl=60))
            return reply

    quiet = DNSLogger(log="-request,-reply,-truncated,-error,-recv,-send,-data", prefix=False)
    return [
        # Bound to its own address: a UDP reply from 0.0.0.0 would leave from the veth's
        # address, and resolvers drop answers from an address they did not ask.
        DNSServer(Zone(), port=53, address=address, tcp=tcp, logger=quiet) for tcp in (False, True)
    ]


def main(config_path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: gone with the process that started us
    with open(config_path) as f:
        config = json.load(f)
    _setup_interfaces(config["addresses"])
    servers: list[Any] = [
        _TCP(("0.0.0.0", 7), _Echo),
        _TCP(("0.0.0.0", 19), _Source),
    ]
    servers[1].zeros = config["zeros"]  # type: ignore[attr-defined]
    web = functools.partial(_Web, directory=config["index"])
    servers.append(_HTTP(("0.0.0.0", 80), web))
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(config["cert"], config["key"])
    https = _HTTP(("0.0.0.0", 443), web)
    https.socket = tls.wrap_socket(https.socket, server_side=True)
    servers.append(https)
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    for dns in _dns_servers(config["zone"], config["dns"]):
        dns.start_thread()
    # Probe our own DNS over UDP once, so "ready" means every service answers.
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.settimeout(5)
    probe.sendto(b"\x00\x01\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00\x00\x01\x00\x01", (config["dns"], 53))
    probe.recv(512)
    probe.close()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdin.buffer.read()  # until the test process closes stdin (or dies)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
