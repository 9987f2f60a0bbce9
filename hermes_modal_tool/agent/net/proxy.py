"""``egress.proxy: true``: HTTP(S) only through a forward proxy the agent runs.

Stdlib-only, Python 3.8. One :class:`ForwardProxy` per sandbox listens in the
sandbox's router namespace on :data:`ADDRESS`:\\ :data:`PORT` (an address of the
router's ``lo``, reached from every slot through its veth pair); slots get
``HTTP_PROXY``/``HTTPS_PROXY`` (and the lower-case forms) pointing at it, and their
nftables table refuses every other forwarded connection (:func:`.nftrules.slot_ruleset`
with ``proxy``), so a direct ``connect`` fails at once.

What it serves, per connection (a thread each, at most :data:`MAX_CONNECTIONS` at once
for the sandbox and :data:`MAX_PER_SLOT` for one slot; more are closed at once; a request head of at most :data:`MAX_HEAD` bytes within
:data:`HEAD_TIMEOUT` seconds):

- ``CONNECT host:port`` (HTTPS and any TCP): ``200`` then bytes both ways;
- ``GET``/``POST``/... with an absolute ``http://`` URI: the request is sent on with
  an origin-form target (``Proxy-*`` headers dropped), then bytes both ways.

The slot is known by the connection's source address (its veth pair's /30), and its own
:class:`.policy.EgressPolicy` decides: a name is resolved through the slot's resolver
(:meth:`.resolver.DnsResolver.answer`: names not allowed are NXDOMAIN, allowed ones
teach the policy their addresses), then every address is checked like a direct
connection would be (deny, default-denied ranges, the host's addresses). A refusal is
``403 Forbidden`` with the reason in the body, counted in :attr:`ForwardProxy.refused`.
"""

import ipaddress
import socket
import struct
import threading

from . import dnswire
from .policy import normalize_name

ADDRESS, PORT = "10.253.0.1", 3128
MAX_HEAD = 16384
HEAD_TIMEOUT = 10.0
CONNECT_TIMEOUT = 5.0
MAX_CONNECTIONS = 256
MAX_PER_SLOT = 64  # so that one slot cannot take every connection of its sandbox
_DROPPED = (b"proxy-connection", b"proxy-authorization", b"keep-alive")


def proxy_env(address=ADDRESS, port=PORT):
    """The variables that send a slot's HTTP(S) clients through the proxy."""
    url = "http://%s:%d" % (address, port)
    env = {}
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[key] = env[key.lower()] = url
    env["NO_PROXY"] = env["no_proxy"] = "localhost,127.0.0.1,::1"
    return env


def a_query(name, ident=0x4850):
    """A DNS query (bytes) for the ``A`` records of ``name``.

    Raises:
        ValueError: ``name`` is not a domain name (a label empty or over 63 bytes).
    """
    out = b""
    for label in normalize_name(name).split("."):
        raw = label.encode("ascii")
        if not 0 < len(raw) < 64:
            raise ValueError("not a domain name: %r" % name)
        out += struct.pack("!B", len(raw)) + raw
    return struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0) + out + b"\0" + struct.pack("!HH", 1, 1)


class Refused(Exception):
    """A request the proxy will not serve (the message says why)."""


def parse_head(head):
    """``(method, host, port, rewritten head or None)`` of one request head (bytes,
    ending with an empty line). ``CONNECT`` gives ``None``; an absolute ``http://``
    URI gives the head to send on (origin-form target, ``Proxy-*`` headers dropped).

    Raises:
        Refused: a malformed request, or a target other than ``host:port`` / ``http://``.
    """
    lines = head.split(b"\r\n")
    try:
        method, target, version = lines[0].decode("latin-1").split(" ")
    except ValueError:
        raise Refused("malformed request line") from None
    if method == "CONNECT":
        host, port = _host_port(target, None)
        return method, host, port, None
    if not target.lower().startswith("http://"):
        raise Refused("only CONNECT and absolute http:// URIs go through this proxy")
    rest = target[7:]
    authority, slash, path = rest.partition("/")
    host, port = _host_port(authority, 80)
    keep = [h for h in lines[1:] if h and h.split(b":", 1)[0].strip().lower() not in _DROPPED]
    first = ("%s /%s %s" % (method, path if slash else "", version)).encode("latin-1")
    return method, host, port, b"\r\n".join([first] + keep + [b"", b""])


def _host_port(text, default):
    if text.startswith("["):
        host, _, port = text[1:].partition("]")
        port = port[1:] if port.startswith(":") else ""
    else:
        host, _, port = text.rpartition(":") if text.count(":") == 1 else (text, "", "")
    if not port and default is None:
        raise Refused("CONNECT needs host:port")
    try:
        number = int(port) if port else default
    except ValueError:
        raise Refused("bad port %r" % port) from None
    if not host or not 0 < number < 65536:
        raise Refused("bad target %r" % text)
    return host, number


class ForwardProxy:
    """The sandbox's forward proxy (see the module doc).

    Args:
        slot_of: ``slot_of(source address string)`` -> ``(policy, resolver)`` of the slot
            using that address, or None (the connection is closed).
        bind: ``(address, port)`` to listen on; made in the namespace of the thread that
            calls :meth:`start` (the router's).
    """

    def __init__(self, slot_of, bind=(ADDRESS, PORT)):
        self.slot_of = slot_of
        self._bind = bind
        self._sock = None
        self._closed = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self.refused = {}  # source address -> requests refused
        self._open = {}  # source address -> connections being served
        self.served = 0

    def start(self):
        """Listen and serve from a thread (started here: it and its connection threads
        stay in the caller's network namespace); returns ``self``."""
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(self._bind)
        self._sock.listen(128)
        threading.Thread(target=self._serve, name="hmt-proxy", daemon=True).start()
        return self

    def _serve(self):
        while not self._closed.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            with self._lock:
                busy = self._open.get(peer[0], 0) >= MAX_PER_SLOT
                if not busy:
                    self._open[peer[0]] = self._open.get(peer[0], 0) + 1
            if busy or not self._slots.acquire(blocking=False):
                if not busy:
                    self._done(peer[0])
                conn.close()  # the slot's (or the sandbox's) connections are all in use
                continue
            threading.Thread(target=self._handle, args=(conn, peer[0]), name="hmt-proxy-conn",
                             daemon=True).start()

    def _handle(self, conn, peer):
        upstream = None
        try:
            slot = self.slot_of(peer)
            if slot is None:
                return
            conn.settimeout(HEAD_TIMEOUT)
            try:
                head, rest = _read_head(conn)
                method, host, port, forward = parse_head(head)
                address = self._destination(slot, host, port)
            except Refused as exc:
                with self._lock:
                    self.refused[peer] = self.refused.get(peer, 0) + 1
                body = ("refused by the sandbox's egress policy: %s\n" % exc).encode()
                conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\n"
                             b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                return
            try:
                upstream = socket.create_connection((address, port), timeout=CONNECT_TIMEOUT)
            except OSError:
                conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
                return
            with self._lock:
                self.served += 1
            if method == "CONNECT":
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                if rest:
                    upstream.sendall(rest)
            else:
                upstream.sendall(forward + rest)
            conn.settimeout(None)
            upstream.settimeout(None)
            other = threading.Thread(target=_pipe, args=(upstream, conn), daemon=True)
            other.start()
            _pipe(conn, upstream)
            other.join()
        except OSError:
            pass
        finally:
            for s in (conn, upstream):
                if s is not None:
                    s.close()
            self._slots.release()
            self._done(peer)

    def _done(self, peer):
        with self._lock:
            left = self._open.get(peer, 1) - 1
            if left:
                self._open[peer] = left
            else:
                self._open.pop(peer, None)

    def _destination(self, slot, host, port):
        """The address to connect to for ``host`` under the slot's policy.

        Raises:
            Refused: the name does not resolve under the policy, or no address is allowed.
        """
        policy, resolver = slot
        try:
            addresses = [ipaddress.ip_address(host)]
        except ValueError:
            try:
                query = a_query(host)
            except ValueError as exc:
                raise Refused(str(exc)) from None
            reply = resolver.answer(query)
            _, _, question = dnswire.parse_query(query)
            try:
                rcode, addresses, _ttl = dnswire.answer_addresses(reply, question)
            except dnswire.DnsFormatError:
                raise Refused("%s: no answer" % host) from None
            if not addresses:
                raise Refused("%s does not resolve under the policy (rcode %d)" % (host, rcode)) from None
        why = "no address"
        for address in addresses:
            verdict = policy.check(address, port)
            if verdict.allowed:
                return str(address)
            why = verdict.reason
        raise Refused("%s:%d: %s" % (host, port, why))

    def close(self):
        """Stop listening (open connections end with their peers). Idempotent."""
        self._closed.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()


def _read_head(conn):
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HEAD:
            raise Refused("request head over %d bytes" % MAX_HEAD)
        chunk = conn.recv(4096)
        if not chunk:
            raise OSError("closed before the request head ended")
        data += chunk
    end = data.index(b"\r\n\r\n") + 4
    return data[:end], data[end:]


def _pipe(src, dst):
    try:
        while True:
            chunk = src.recv(65536)
            if not chunk:
                break
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
