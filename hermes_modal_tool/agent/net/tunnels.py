"""The ``tunnel`` op: a TCP connection to a port inside a slot, opened by the agent in the
slot's network namespace, its bytes carried over the protocol's stream (previews: the
agent's side of ``hermes_modal_tool/previews.py``).

Stdlib-only, Python 3.8.

The slot never reaches the host: the agent makes the socket in the slot's own network
namespace (``network: egress``: the namespace the agent made, :mod:`.slotnet`;
``network: none``: the namespace bubblewrap made, entered through the slot's init
process, checked to still be the slot's; ``network: host``: the agent's own) and
connects it to ``127.0.0.1:port`` there. Only the socket's creation happens in a worker
thread that enters the namespace (a socket keeps the namespace it was made in); the
connect and every read and write are non-blocking, on the loop.

Flow control, per tunnel: the host asks for data (``read``), at most a few requests
ahead, and the agent reads from the socket only while a request waits (else the
transport is paused: at most one read's bytes are held); a ``write`` is answered once
the socket's send buffer has room again (the host keeps a few unanswered). A slow
browser therefore leaves bytes in the slot's socket, never in the agent, and never
holds the loop that serves the other slots.
"""

import asyncio
import collections
import itertools
import os
import socket

from .netns import entered

#: Bytes in one ``read`` answer (one binary frame).
CHUNK_BYTES = 64 * 1024
#: Seconds a ``read`` waits for data before it is answered empty (``idle``): the host asks again.
IDLE_S = 20.0
#: Tunnels open at once per sandbox.
MAX_TUNNELS = 256
#: Bytes queued in a tunnel's transport before a ``write`` answer waits for them to drain.
WRITE_HIGH = 256 * 1024
#: Bytes of frames the agent may have queued for the host before a ``read`` answer waits
#: (and seconds before it looks again), as for downloads (``files/streamout.py``).
BULK_BACKLOG = 256 * 1024
BULK_RETRY_S = 0.001

_ids = itertools.count(1)


class TunnelError(Exception):
    """A tunnel the agent refuses or cannot open; the message goes to the host."""


def tunnels_of(agent):
    t = getattr(agent, "tunnels", None)
    if t is None:
        t = agent.tunnels = {}
    return t


def dispatch(agent, msg):
    """Serve a ``tunnel`` message (see ``protocol``)."""
    mid = msg.get("id")
    tid = msg.get("tunnel")
    if tid is None:
        agent.own(_open(agent, msg))
        return
    tunnel = tunnels_of(agent).get(tid)
    if tunnel is None:
        if msg.get("close"):
            agent.send({"id": mid, "ok": True, "result": {}})
        else:
            agent.send({"id": mid, "ok": False, "error": "no tunnel %r (closed)" % (tid,)})
        return
    tunnel.request(msg)


def _netns_of(agent, slot):
    """``(fd, inode, own)`` of the namespace to connect in (``own``: close ``fd`` after),
    or None for the agent's own (``network: host``).

    Raises:
        TunnelError: the slot has no namespace yet (nothing of it runs), or it changed.
    """
    if agent.network == "host":
        return None
    if agent.net is not None:  # egress: the namespace the agent made for the slot
        net = agent.net.slots.get(slot.index)
        if net is None:
            raise TunnelError("slot %d has no network namespace yet (nothing runs in it)" % slot.index)
        return net.fd, net.inode, False
    shell = slot.shell
    init = shell._init() if shell.proc is not None else None
    if not init or shell.ns_link is None:
        raise TunnelError("slot %d has no network namespace yet (nothing runs in it)" % slot.index)
    fd = os.open("/proc/%d/ns/net" % init, os.O_RDONLY | os.O_CLOEXEC)
    try:
        # The pid is still the slot's init (not a number reused since): its PID namespace is
        # the one recorded at the shell's start, read after the descriptor was opened.
        if os.readlink("/proc/%d/ns/pid" % init) != shell.ns_link:
            raise TunnelError("slot %d's shell ended" % slot.index)
        return fd, os.fstat(fd).st_ino, True
    except BaseException:
        os.close(fd)
        raise


def _socket_in(ns):
    """A non-blocking TCP socket made in namespace ``ns`` (blocking: a worker thread)."""
    if ns is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    else:
        with entered(ns[0], ns[1]):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    return sock


async def _open(agent, msg):
    mid = msg.get("id")
    slot = agent.slots.get(msg.get("slot"))
    port = msg.get("port")
    ns = None
    try:
        if slot is None:
            raise TunnelError("no slot %r in this sandbox" % (msg.get("slot"),))
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise TunnelError("port must be a whole number from 1 to 65535, got %r" % (port,))
        if len(tunnels_of(agent)) >= MAX_TUNNELS:
            raise TunnelError("%d tunnels are open in this sandbox already" % MAX_TUNNELS)
        ns = _netns_of(agent, slot)
        sock = await agent.loop.run_in_executor(agent.executor("files"), _socket_in, ns)
        try:
            await asyncio.wait_for(agent.loop.sock_connect(sock, ("127.0.0.1", port)), 10)
        except BaseException:
            sock.close()
            raise
        tid = "t%d" % next(_ids)
        tunnel = Tunnel(agent, slot.index, tid)
        await agent.loop.create_connection(lambda: tunnel, sock=sock)
        tunnels_of(agent)[tid] = tunnel
        agent.send({"id": mid, "ok": True, "result": {"tunnel": tid}})
    except ConnectionRefusedError:
        agent.send({"id": mid, "ok": False, "error": "nothing listens on port %r in slot %s"
                    % (port, msg.get("slot"))})
    except asyncio.TimeoutError:
        agent.send({"id": mid, "ok": False, "error": "port %r of slot %s did not answer within 10 s"
                    % (port, msg.get("slot"))})
    except (TunnelError, OSError) as exc:
        agent.send({"id": mid, "ok": False, "error": str(exc)})
    finally:
        if ns is not None and ns[2]:
            os.close(ns[0])


class Tunnel(asyncio.Protocol):
    """One connection into a slot (on the agent's loop)."""

    def __init__(self, agent, index, tid):
        self.agent, self.index, self.tid = agent, index, tid
        self.transport = None
        self.buf = bytearray()  # read from the slot, not yet asked for
        self.reads = collections.deque()  # (request id, idle timer)
        self.writes = collections.deque()  # request ids answered once the transport drains
        self.paused_writing = False
        self.eof = False
        self.closed = False
        self.retry = None  # the timer of a read held back (the stream's backlog)

    # -- asyncio.Protocol ------------------------------------------------------------
    def connection_made(self, transport):
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH)
        transport.pause_reading()  # until the host asks

    def data_received(self, data):
        self.buf += data
        if self.retry is None:
            self._answer_reads()
        if self.buf and (not self.reads or self.retry is not None):
            self.transport.pause_reading()

    def eof_received(self):
        self.eof = True
        self._answer_reads()
        return True  # keep our side open for writes (a half-closed request)

    def connection_lost(self, exc):
        self.eof = True
        self.closed = True
        self._answer_reads()
        self._answer_writes("the slot's side of tunnel %s closed" % self.tid)

    def pause_writing(self):
        self.paused_writing = True

    def resume_writing(self):
        self.paused_writing = False
        self._answer_writes()

    # -- requests ----------------------------------------------------------------------
    def request(self, msg):
        mid = msg.get("id")
        if msg.get("close"):
            self.close()
            self.agent.send({"id": mid, "ok": True, "result": {}})
        elif msg.get("read"):
            if len(self.reads) >= 8:
                self.agent.send({"id": mid, "ok": False, "error": "too many reads waiting"})
                return
            timer = self.agent.loop.call_later(IDLE_S, self._idle, mid)
            self.reads.append((mid, timer))
            self._answer_reads()
        elif msg.get("end"):
            if not self.closed and self.transport.can_write_eof():
                self.transport.write_eof()
            self.agent.send({"id": mid, "ok": True, "result": {}})
        elif "blob" in msg:
            if self.closed:
                self.agent.send({"id": mid, "ok": False, "error": "tunnel %s is closed" % self.tid})
                return
            self.transport.write(msg["blob"])
            self.writes.append(mid)
            if not self.paused_writing:
                self._answer_writes()
        else:
            self.agent.send({"id": mid, "ok": False, "error": "a tunnel message needs read, "
                             "blob, end or close"})

    def _answer_reads(self):
        if self.retry is not None:
            self.retry.cancel()  # (harmless when it is the timer that calls)
            self.retry = None
        while self.reads and (self.buf or self.eof):
            if self.buf and _backlog(self.agent) >= BULK_BACKLOG:
                # As a download does: a neighbour's result never waits behind more than
                # BULK_BACKLOG of tunnel bytes on the shared stream. When what waits is
                # mostly this loop pass's frames and their flush is due at once, look again
                # right after it (the flush was queued first); else in BULK_RETRY_S. Always
                # waiting BULK_RETRY_S capped a preview's download at ~185 MB/s (64 MiB
                # through ``python3 -m http.server``, median of 6 on the loaded 2-core
                # machine; ~238 MB/s looking again at once).
                agent = self.agent
                if agent.flush_soon and agent.out.get_write_buffer_size() < BULK_BACKLOG:
                    self.retry = agent.loop.call_soon(self._answer_reads)
                else:
                    self.retry = agent.loop.call_later(BULK_RETRY_S, self._answer_reads)
                return
            mid, timer = self.reads.popleft()
            timer.cancel()
            if self.buf:
                blob = bytes(self.buf[:CHUNK_BYTES])
                del self.buf[:CHUNK_BYTES]
                self.agent.send({"id": mid, "ok": True, "result": {"eof": False}, "blob": blob})
            else:
                self.agent.send({"id": mid, "ok": True, "result": {"eof": True}, "blob": b""})
        if self.reads and not self.buf and not self.eof and self.transport is not None:
            self.transport.resume_reading()

    def _idle(self, mid):
        for i, (rid, _timer) in enumerate(self.reads):
            if rid == mid:
                del self.reads[i]
                self.agent.send({"id": mid, "ok": True, "result": {"eof": False, "idle": True},
                                 "blob": b""})
                return

    def _answer_writes(self, error=None):
        while self.writes:
            mid = self.writes.popleft()
            if error is None:
                self.agent.send({"id": mid, "ok": True, "result": {}})
            else:
                self.agent.send({"id": mid, "ok": False, "error": error})

    def close(self):
        """Close the connection and forget the tunnel (on the loop). Idempotent."""
        tunnels_of(self.agent).pop(self.tid, None)
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self.closed = self.eof = True
        self.buf = bytearray()  # nothing more goes to the host
        self._answer_reads()
        self._answer_writes("tunnel %s was closed" % self.tid)


def _backlog(agent):
    return agent.out.get_write_buffer_size() + sum(len(frame) for frame in agent.outbox)


def drop_slot(agent, index):
    """Close the tunnels into slot ``index`` (its reset)."""
    for tunnel in list(tunnels_of(agent).values()):
        if tunnel.index == index:
            tunnel.close()


def drop_all(agent):
    """Close every tunnel (the agent shuts down)."""
    for tunnel in list(tunnels_of(agent).values()):
        tunnel.close()
