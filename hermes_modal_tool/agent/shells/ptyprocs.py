"""Processes of a slot that run beside its shell: with a PTY (interactive programs) or
pipes; written to, read incrementally, resized, signalled, waited for, listed.

Stdlib-only, Python 3.8. A ``bash`` call with ``pty: true`` starts one (``rows`` and
``cols`` give the terminal's size): the slot's shell starts the helper of
:mod:`.ptyhelper` with ``python3`` (so the process has the slot's uid, namespaces,
limits, working directory and exported variables), the helper connects to a socket
the agent listens on in the slot's control directory (read-only to the slot), and
everything then goes through that connection, never through the shell. Output is
kept per process, its last :data:`KEEP_BYTES` or less (:func:`caps`); a read returns
what came since the previous read. A slot has at most the profile's ``slot_processes``
running (one more is refused, naming the cap; ended ones are forgotten, oldest first,
to make room), so the agent holds at most ``slot_process_output`` MiB of their output
per slot. Every pid the agent records comes from the kernel (:mod:`.owned`). A reset of the slot (its release) kills every process it started,
these too, and forgets them.

Requests (host -> agent): ``{"op": "process", "slot": N, "action": A, "process": ID, ...}``
with ``A`` one of ``write`` (``data`` str or ``data_b64``; ``eof`` true: end of input),
``read`` (``wait_s``: wait that long for output or the exit), ``resize`` (``rows``,
``cols``), ``signal`` (``signal``: a number), ``wait`` (``timeout_s``) and ``list``.
"""

import asyncio
import base64
import itertools
import os
import socket
import struct

from ... import protocol
from . import owned, ptyhelper

#: Output bytes kept per process at most (older output is dropped and counted); less
#: when the profile's ``slot_process_output`` / ``slot_processes`` is less (:func:`caps`).
KEEP_BYTES = 1 << 20
#: Defaults of the per-slot caps when the sandbox's configuration names none.
MAX_PROCESSES = 16
MAX_OUTPUT_MB = 16
#: Input bytes waiting for a process beyond which a write is refused.
MAX_UNSENT = 1 << 20
#: Seconds the helper has to connect after the shell started it.
CONNECT_S = 15.0
_IDS = itertools.count(1)


class Proc:
    """One process of a slot, as the agent sees it."""

    def __init__(self, slot_index, pid, command, pty, conn, loop, keep=KEEP_BYTES):
        self.id = next(_IDS)
        self.keep = keep  # output bytes kept (the slot's share: caps())
        self.slot_index = slot_index
        self.pid = pid  # as the slot sees it; found in /proc (owned.py), never as told
        self.told = False  # the helper said its process exists (it waits for "g" to exec)
        self.command = command
        self.pty = pty
        self.conn = conn
        self.loop = loop
        self.buf = bytearray()
        self.base = 0  # offset (in all output) of buf[0]
        self.cursor = 0  # where the next read starts
        self.returncode = None
        self.running = True
        self.changed = loop.create_future()
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.writing = False
        loop.add_reader(conn.fileno(), self._on_readable)

    def describe(self):
        return {"id": self.id, "pid": self.pid, "command": self.command[:200], "pty": self.pty,
                "running": self.running, "returncode": self.returncode}

    def _wake(self):
        if not self.changed.done():
            self.changed.set_result(None)
        self.changed = self.loop.create_future()

    def _on_readable(self):
        try:
            data = self.conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        inbox = self.inbox
        inbox += data
        while len(inbox) >= 5:
            size = struct.unpack(">I", bytes(inbox[1:5]))[0]
            if size > 1 << 20:  # not the helper speaking: stop listening to it
                self.close()
                return
            if len(inbox) < 5 + size:
                break
            kind, payload = bytes(inbox[:1]), bytes(inbox[5:5 + size])
            del inbox[:5 + size]
            if kind == b"o":
                self.buf += payload
                if len(self.buf) > self.keep:
                    cut = len(self.buf) - self.keep
                    del self.buf[:cut]
                    self.base += cut
            elif kind == b"p":
                self.told = True  # the helper forked; the agent finds the pid in /proc
            elif kind == b"x":
                self.returncode = _int(payload, None)
                self.running = False
        self._wake()

    def send(self, kind, data):
        """Queue a frame for the helper (never blocks the agent's loop)."""
        if not self.running or self.conn is None:
            raise ProcessError("process %d has ended (exit code %s)" % (self.id, self.returncode))
        if len(self.outbox) > MAX_UNSENT:
            raise ProcessError("process %d is not reading its input (%d bytes wait)"
                               % (self.id, len(self.outbox)))
        self.outbox += kind + struct.pack(">I", len(data)) + data
        self._flush()

    def _flush(self):
        if self.conn is None:
            return
        try:
            sent = self.conn.send(self.outbox)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self.close()
            return
        del self.outbox[:sent]
        if self.outbox and not self.writing:
            self.writing = True
            self.loop.add_writer(self.conn.fileno(), self._flush)
        elif not self.outbox and self.writing:
            self.writing = False
            self.loop.remove_writer(self.conn.fileno())

    def read(self):
        start = max(self.cursor, self.base)
        skipped = start - self.cursor
        data = bytes(self.buf[start - self.base:])
        self.cursor = self.base + len(self.buf)
        return data, skipped

    def close(self):
        """The helper is gone (the process ended, or the slot was reset)."""
        if self.conn is not None:
            try:
                self.loop.remove_reader(self.conn.fileno())
                if self.writing:
                    self.loop.remove_writer(self.conn.fileno())
            except (ValueError, OSError):
                pass
            self.conn.close()
            self.conn = None
        self.running = False
        self._wake()


class ProcessError(Exception):
    """A process request that cannot be served (reported as the request's error)."""


def caps(agent):
    """``(processes, keep_bytes)``: how many processes started through the API one slot
    may have running (``limits.processes``: the profile's ``slot_processes``) and the
    output bytes each keeps, so that one slot's processes keep at most
    ``limits.process_output_mb`` MiB together (``slot_process_output``)."""
    limits = (getattr(agent, "config", None) or {}).get("limits") or {}
    most = int(limits.get("processes") or MAX_PROCESSES)
    total = int(limits.get("process_output_mb") or MAX_OUTPUT_MB) << 20
    return most, max(4096, min(KEEP_BYTES, total // most))


def make_room(agent, slot):
    """Forget the slot's oldest ended processes until one more fits under its cap; None
    then, else the failed ``call`` result that names the cap (every one still runs)."""
    most, _ = caps(agent)
    procs = table(agent)
    mine = sorted((p for p in procs.values() if p.slot_index == slot.index), key=lambda p: p.id)
    ended = [p for p in mine if not p.running]
    while len(mine) >= most and ended:
        gone = ended.pop(0)
        mine.remove(gone)
        procs.pop(gone.id).close()
    if len(mine) < most:
        return None
    return protocol.call_result(
        error="slot %d already has %d processes running that were started through the API "
              "(start_process, bash with background), its limit (the profile's slot_processes: "
              "%d); wait for one to end or signal it first" % (slot.index, len(mine), most),
        returncode=1)


def table(agent):
    procs = getattr(agent, "processes", None)
    if procs is None:
        procs = agent.processes = {}
    return procs


async def start(agent, slot, command, env, rows, cols, pty, log=None, connect_s=CONNECT_S):
    """Start ``command`` as a process of ``slot``; return a ``call`` result (data
    ``{"process": {"id", "pid", "pty"}}``). ``log``: a path as the slot sees it to append
    the output to as well (a background job's); then, in a slot without ``python3``,
    None: the caller starts the job its own way. ``connect_s``: seconds the helper has to
    connect, and then to report the process started.

    The pids come from the kernel (:mod:`.owned`), never from what the slot's shell or
    the helper print: the helper is the connection's peer (``SO_PEERCRED``) and must be
    the slot's; the process is the helper's one child leading a session of its own, held
    before ``exec`` until the agent has found it (a fast command cannot end first).
    A slot at its cap of processes (:func:`caps`) gets a failed result naming it."""
    full = make_room(agent, slot)
    if full is not None:
        return full
    n = next(_IDS)
    name = "proc_%d.sock" % n
    host_path = os.path.join(slot.ctl_host, name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        listener.bind(host_path)
        os.chmod(host_path, 0o666)  # the slot's uid connects; only that slot sees the directory
        listener.listen(1)
        listener.setblocking(False)
        helper = slot.write_ctl("ptyhelper.py", ptyhelper.SOURCE.encode())
        script = slot.write_ctl("proc_%d.sh" % n, command.encode("utf-8", "surrogatepass") + b"\n")
        prefix = "".join("%s=%s " % (k, _q(v)) for k, v in env.items())
        # `return`, not `exit`: the shell sources this file (an exit would end the shell).
        launcher = ("command -v python3 >/dev/null 2>&1 || { echo 'python3 is not in the slot: "
                    "processes need it'; return %d; }\n" % (3 if log else 1))
        if log:
            launcher += "mkdir -p %s || return 1\n" % _q(os.path.dirname(log))
        launcher += ("%ssetsid python3 %s %s %d %d %d %s %s</dev/null >/dev/null 2>&1 &\n" % (
            prefix, _q(helper), _q("%s/%s" % (slot.ctl_path, name)), rows, cols, 1 if pty else 0,
            _q(script), _q(log) + " " if log else ""))
        res = await slot.shell.run(launcher.encode("utf-8", "surrogatepass"), "/dev/null", {},
                                   10.0, 4096)
        if log and res["returncode"] == 3:
            return None
        if res["returncode"] != 0:
            return protocol.call_result(
                error="could not start the process: %s" % (res["error"] or res["output"].strip()),
                returncode=1)
        try:
            conn, _ = await asyncio.wait_for(agent.loop.sock_accept(listener), connect_s)
        except asyncio.TimeoutError:
            return protocol.call_result(error="the process's helper did not connect within %gs"
                                        % connect_s, returncode=1)
    finally:
        listener.close()
        try:
            os.unlink(host_path)
        except OSError:
            pass
    helper_pid = owned.peer_pid(conn)
    if helper_pid is None or not owned.belongs(slot, helper_pid):
        conn.close()
        return protocol.call_result(
            error="could not start the process: what connected to its socket (pid %s) is not a "
                  "process of this slot" % (helper_pid,), returncode=1)
    conn.setblocking(False)
    proc = Proc(slot.index, None, command, pty, conn, agent.loop, caps(agent)[1])
    deadline = agent.loop.time() + connect_s
    while not proc.told and proc.running and agent.loop.time() < deadline:
        try:
            await asyncio.wait_for(asyncio.shield(proc.changed), deadline - agent.loop.time())
        except asyncio.TimeoutError:
            break
    kids = owned.session_children(slot, helper_pid) if proc.told else []
    pid = owned.slot_view(slot, kids[0]) if len(kids) == 1 else None
    if pid is None:
        proc.close()  # the helper kills what it started
        return protocol.call_result(
            error="could not start the process: its helper (pid %d) started no process of this "
                  "slot in a session of its own" % helper_pid, returncode=1)
    proc.pid = pid
    table(agent)[proc.id] = proc
    proc.send(b"g", b"")  # found: the process may exec its command
    slot.background_sids.append(pid)  # its own session: a timeout of a later command spares it
    return protocol.call_result(
        output="started process %d (pid %d)%s" % (proc.id, pid, " on a terminal" if pty else ""),
        returncode=0, data={"process": {"id": proc.id, "pid": pid, "pty": pty}})


def forget(agent, slot_index):
    """The slot is being reset: drop its processes (the reset kills them)."""
    procs = table(agent)
    for pid in [k for k, p in procs.items() if p.slot_index == slot_index]:
        procs.pop(pid).close()


def dispatch(agent, msg):
    """Serve one ``process`` request (answered with ``{"id", "ok", "result"|"error"}``)."""
    agent.own(_serve(agent, msg))


async def _serve(agent, msg):
    mid = msg.get("id")
    try:
        result = await _act(agent, msg)
    except ProcessError as exc:
        agent.send({"id": mid, "ok": False, "error": str(exc)})
    except Exception as exc:  # noqa: BLE001 - reported, the agent goes on
        agent.send({"id": mid, "ok": False, "error": "process %s failed: %s: %s"
                    % (msg.get("action"), type(exc).__name__, exc)})
    else:
        agent.send({"id": mid, "ok": True, "result": result})


async def _act(agent, msg):
    action = msg.get("action")
    index = msg.get("slot")
    if action == "list":
        return {"processes": [p.describe() for p in table(agent).values() if p.slot_index == index]}
    proc = table(agent).get(msg.get("process"))
    if proc is None or proc.slot_index != index:
        raise ProcessError("no process %r in this slot (it was never started here, the slot "
                           "was released, or it had ended and was forgotten to make room for "
                           "another: slot_processes)" % (msg.get("process"),))
    if action == "write":
        data = msg.get("data_b64")
        data = base64.b64decode(data) if data is not None else str(msg.get("data") or "").encode(
            "utf-8", "surrogatepass")
        if data:
            proc.send(b"i", data)
        if msg.get("eof"):
            proc.send(b"e", b"")
        return {}
    if action == "resize":
        rows, cols = msg.get("rows"), msg.get("cols")
        if not all(isinstance(v, int) and 0 < v < 65536 for v in (rows, cols)):
            raise ProcessError("rows and cols must be whole numbers from 1 to 65535, got %r, %r"
                               % (rows, cols))
        proc.send(b"r", ("%d %d" % (rows, cols)).encode())
        return {}
    if action == "signal":
        sig = msg.get("signal")
        if not isinstance(sig, int) or isinstance(sig, bool) or not 0 < sig < 65:
            raise ProcessError("signal must be a signal number from 1 to 64, got %r" % (sig,))
        proc.send(b"s", str(sig).encode())
        return {}
    if action in ("read", "wait"):
        limit = msg.get("wait_s" if action == "read" else "timeout_s") or 0.0
        if action == "read" and proc.cursor < proc.base + len(proc.buf):
            limit = 0.0
        deadline = agent.loop.time() + float(limit)
        while proc.running and (action == "wait" or proc.cursor >= proc.base + len(proc.buf)):
            left = deadline - agent.loop.time()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(asyncio.shield(proc.changed), left)
            except asyncio.TimeoutError:
                break
        out = {"running": proc.running, "returncode": proc.returncode}
        if action == "read":
            data, skipped = proc.read()
            out.update(data_b64=base64.b64encode(data).decode("ascii"), skipped=skipped)
        return out
    raise ProcessError("unknown process action %r; known: write, read, resize, signal, wait, list"
                       % (action,))


def _int(data, default):
    try:
        return int(data)
    except ValueError:
        return default


def _q(value):
    return "'" + str(value).replace("'", "'\"'\"'") + "'"
