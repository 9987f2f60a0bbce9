"""Which processes provably belong to a slot: facts from the kernel, never a slot's output.

Stdlib-only, Python 3.8. Whatever a slot prints (``echo $!`` through a redefined
``echo``, a helper's "my child is pid N") is the slot's to choose; the agent runs as
root and signals what it records, so it records only what the kernel says: the peer of
a socket connection (``SO_PEERCRED``), ``/proc/<pid>/task/<pid>/children`` of a process
it already knows to be the slot's, and a process's PID namespace, uid and session in
``/proc``. A process belongs to a slot when it is in the slot's PID namespace (bwrap),
runs as the slot's own uid (no bwrap, the agent root), or descends from the slot's
shell (no bwrap, every slot the agent's own uid).
"""

import os
import socket
import struct

from .procs import read_proc


def peer_pid(conn):
    """The pid (in the agent's PID namespace) of the process at the other end of the
    Unix socket ``conn``, as the kernel recorded it when it connected; None if unknown."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid = struct.unpack("3i", raw)[0]
    return pid if pid > 0 else None


def _status(pid):
    """``{"Uid": [...], "NSpid": [...], "PPid": [...]}`` of ``pid`` (ints), {} if gone."""
    out = {}
    for line in read_proc("/proc/%d/status" % pid).splitlines():
        key, _, value = line.partition(b":")
        if key in (b"Uid", b"NSpid", b"PPid", b"NSsid"):
            try:
                out[key.decode()] = [int(v) for v in value.split()]
            except ValueError:
                pass
    return out


def session_of(pid):
    """The session id of ``pid`` in the agent's PID namespace (``/proc/PID/stat``), or None."""
    stat = read_proc("/proc/%d/stat" % pid).rpartition(b")")[2].split()
    try:
        return int(stat[3])
    except (IndexError, ValueError):
        return None


def belongs(slot, pid):
    """Whether host pid ``pid`` is a process of ``slot`` (see the module's docstring)."""
    shell = slot.shell
    if slot.agent.isolation == "bwrap":
        shell._init()
        link = shell.ns_link
        if link is None:
            return False
        try:
            return os.readlink("/proc/%d/ns/pid" % pid) == link
        except OSError:
            return False
    status = _status(pid)
    if not status.get("Uid"):
        return False
    if slot.uid is not None:
        # Its real uid, as kill(2) judges: a set-uid program the slot ran is still its own.
        return status["Uid"][0] == slot.uid
    # Every slot runs as the agent's own uid: only descent from this slot's shell counts.
    bash = shell.proc.pid if shell.proc is not None else None
    for _ in range(16):
        ppid = (status.get("PPid") or [0])[0]
        if bash is None or ppid <= 1:
            return False
        if ppid == bash:
            return True
        status = _status(ppid)
    return False


def slot_view(slot, pid):
    """Host pid ``pid`` as the slot sees it (one PID namespace below the agent's with
    bwrap, the same without); None if it is gone or not at that level."""
    if slot.agent.isolation != "bwrap":
        return pid
    nspid = _status(pid).get("NSpid") or []
    return nspid[1] if len(nspid) > 1 else None


def session_children(slot, parent):
    """Host pids of the children of ``parent`` that lead a session of their own and
    belong to ``slot`` (the kernel's list of its children, not anything it printed)."""
    out = []
    for child in read_proc("/proc/%d/task/%d/children" % (parent, parent)).split():
        pid = int(child)
        if session_of(pid) == pid and belongs(slot, pid):
            out.append(pid)
    return out


def session_members(slot, sid):
    """Host pids in the session ``sid`` (host numbering) that belong to ``slot``: what a
    slot's release may kill of a background job's session (a number the slot's job once
    had may now be a neighbour's). When every slot runs as the agent's own uid (the
    agent is not root, no bwrap), nothing tells the slots apart: ``sid`` is then one the
    kernel named as the slot's job (:func:`session_children`), and every member counts."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            pid = int(entry)
            if session_of(pid) == sid and (slot.uid is None or belongs(slot, pid)):
                out.append(pid)
    return out


def state_of(pid):
    """``/proc/PID/stat``'s state letter (b"R", b"S", b"T" ...), b"" if gone."""
    return read_proc("/proc/%d/stat" % pid).rpartition(b")")[2][1:2]


def new_children(slot, parent, clock):
    """Host pids of ``parent``'s children that began after ``clock``
    (:func:`.isolation.process_clock`) and belong to ``slot``."""
    from ..limits.isolation import started_after

    out = []
    for child in read_proc("/proc/%d/task/%d/children" % (parent, parent)).split():
        pid = int(child)
        stat = read_proc("/proc/%d/stat" % pid).rpartition(b")")[2].split()
        if len(stat) > 19 and started_after(pid, int(stat[19]), clock) and belongs(slot, pid):
            out.append(pid)
    return out
