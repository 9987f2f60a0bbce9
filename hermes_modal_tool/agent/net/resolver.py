"""A DNS resolver the agent controls: the only one a slot's ``/etc/resolv.conf`` names.

Stdlib-only, Python 3.8. It answers a query for a name the slot's
:class:`.policy.EgressPolicy` refuses with NXDOMAIN itself (nothing goes upstream, the
refusal is counted), forwards a query for an allowed name unchanged to the upstream
resolver, checks that the reply answers that question, records the ``A``/``AAAA``
addresses in it with the policy (:meth:`.policy.EgressPolicy.learn`: connections to them
are allowed until the TTL runs out) and relays the reply. Malformed queries get FORMERR,
an upstream that fails or times out SERVFAIL.

Bounds (a slot must not make the agent do unbounded work): UDP messages of at most
4096 bytes, TCP messages of at most 65535 with 5 s to arrive, the upstream's answer
within ``timeout`` seconds, at most ``workers`` queries in flight (more wait in the
kernel's socket buffer; UDP overflow is dropped, as a busy resolver's would be).

:class:`DnsResolver` serves one policy on a UDP and a TCP socket bound where the slot
can reach (the slot side of its veth pair, or a loopback address of the agent's
namespace that the slot's DNAT rule points to); :meth:`DnsResolver.answer` is the
transport-free core. Threads made by :meth:`DnsResolver.start` inherit the network
namespace of the thread that calls it.
"""

import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

from . import dnswire

MAX_UDP = 4096
TCP_READ_S = 5.0


class DnsResolver:
    """Answers a slot's DNS queries under its policy (see the module doc).

    Args:
        policy: the slot's :class:`.policy.EgressPolicy`.
        upstream: ``(address, port)`` of the resolver allowed queries go to.
        bind: ``(address, port)`` to serve on (UDP and TCP); port 0 picks one
            (see :attr:`address` after :meth:`start`).
        timeout: seconds to wait for the upstream's reply.
        workers: queries answered at once.
        on_learn: called as ``on_learn(name, addresses, ttl)`` in the worker thread
            after the policy learned addresses, before the reply goes to the slot (so
            the slot's connection finds the enforcement point updated; see
            :func:`.nftrules.learn_command`).
    """

    def __init__(self, policy, upstream, bind=("127.0.0.1", 0), timeout=2.0, workers=8, on_learn=None):
        self.policy = policy
        self.on_learn = on_learn
        self.upstream = (str(upstream[0]), int(upstream[1]))
        self.timeout = timeout
        self._bind = bind
        self._workers = workers
        self._lock = threading.Lock()
        self._pool = None
        self._udp = None
        self._tcp = None
        self._threads = []
        self._closed = threading.Event()
        self.address = None
        self.forwarded = 0  # queries sent upstream
        self.refused = 0  # queries answered NXDOMAIN by the policy

    def answer(self, query, tcp=False):
        """The reply (bytes) to one query (bytes), as described in the module doc."""
        try:
            _, _, question = dnswire.parse_query(query)
        except dnswire.DnsFormatError:
            return dnswire.error_reply(query, dnswire.RCODE_FORMERR)
        if not self.policy.name_allowed(question.name):
            with self._lock:
                self.refused += 1
            return dnswire.error_reply(query, dnswire.RCODE_NXDOMAIN)
        try:
            reply = self._ask_upstream(query, tcp)
            _rcode, addresses, ttl = dnswire.answer_addresses(reply, question)
        except (OSError, dnswire.DnsFormatError):
            return dnswire.error_reply(query, dnswire.RCODE_SERVFAIL)
        if reply[:2] != query[:2]:
            return dnswire.error_reply(query, dnswire.RCODE_SERVFAIL)
        with self._lock:
            self.forwarded += 1
        if addresses:
            self.policy.learn(question.name, addresses, ttl)
            if self.on_learn is not None:
                self.on_learn(question.name, addresses, ttl)
        return reply

    def _ask_upstream(self, query, tcp):
        family = socket.AF_INET6 if ":" in self.upstream[0] else socket.AF_INET
        if tcp:
            with socket.create_connection(self.upstream, timeout=self.timeout) as s:
                s.sendall(struct.pack("!H", len(query)) + query)
                return _read_tcp_message(s)
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.settimeout(self.timeout)
            s.connect(self.upstream)  # replies from any other address are dropped
            s.send(query)
            while True:
                reply = s.recv(MAX_UDP)
                if reply[:2] == query[:2]:
                    return reply

    def start(self):
        """Bind the UDP and TCP sockets and start serving; returns ``self``."""
        family = socket.AF_INET6 if ":" in self._bind[0] else socket.AF_INET
        self._udp = socket.socket(family, socket.SOCK_DGRAM)
        self._udp.bind(self._bind)
        self.address = self._udp.getsockname()[:2]
        self._tcp = socket.socket(family, socket.SOCK_STREAM)
        self._tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._tcp.bind(self.address)
        self._tcp.listen(16)
        self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="slot-dns")
        for target in (self._serve_udp, self._serve_tcp):
            thread = threading.Thread(target=target, name="slot-dns-listen", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _serve_udp(self):
        while not self._closed.is_set():
            try:
                query, peer = self._udp.recvfrom(MAX_UDP)
            except OSError:
                return
            self._pool.submit(self._reply_udp, query, peer)

    def _reply_udp(self, query, peer):
        reply = self.answer(query)
        if len(reply) > 512:  # a plain UDP client takes 512 bytes: set TC, it asks over TCP
            try:
                _, _, question = dnswire.parse_query(query)
                reply = reply[:2] + struct.pack("!H", struct.unpack("!H", reply[2:4])[0] | dnswire.FLAG_TC) \
                    + b"\x00\x01\x00\x00\x00\x00\x00\x00" + query[12:question.end]
            except dnswire.DnsFormatError:
                return
        try:
            self._udp.sendto(reply, peer)
        except OSError:
            pass

    def _serve_tcp(self):
        while not self._closed.is_set():
            try:
                conn, _ = self._tcp.accept()
            except OSError:
                return
            self._pool.submit(self._reply_tcp, conn)

    def _reply_tcp(self, conn):
        with conn:
            try:
                conn.settimeout(TCP_READ_S)
                query = _read_tcp_message(conn)
                reply = self.answer(query, tcp=True)
                conn.sendall(struct.pack("!H", len(reply)) + reply)
            except OSError:
                pass

    def close(self):
        """Stop serving and close the sockets; idempotent."""
        self._closed.set()
        for sock in (self._udp, self._tcp):
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _read_tcp_message(sock):
    head = _read_exact(sock, 2)
    return _read_exact(sock, struct.unpack("!H", head)[0])


def _read_exact(sock, n):
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise OSError("connection closed after %d of %d bytes" % (n - left, n))
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
