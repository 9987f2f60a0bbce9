"""What the agent reads in /proc about a slot's processes (cheaply: a few reads each).

Stdlib-only, Python 3.8.
"""

import os

_TICKS = os.sysconf("SC_CLK_TCK")


def tree_usage(root, cap=64):
    """``(wants_cpu, cpu_seconds)`` of ``root`` and its descendants (the first ``cap``):
    whether one is runnable or in disk wait, and the CPU time they and their finished
    children used. Walks ``/proc/PID/task/TID/children``: a few reads for a usual command."""
    todo = [root]
    seen = ticks = 0
    busy = False
    while todo and seen < cap:
        pid = todo.pop()
        seen += 1
        fields = read_proc("/proc/%d/stat" % pid).rpartition(b")")[2].split()
        if len(fields) < 18:
            continue  # gone
        busy = busy or fields[0] in (b"R", b"D")
        ticks += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
        tids = [pid]
        if fields[17] != b"1":  # threads: any of them may compute or have forked
            try:
                tids = [int(t) for t in os.listdir("/proc/%d/task" % pid)]
            except OSError:
                pass
        for tid in tids:
            if tid != pid and not busy:
                state = read_proc("/proc/%d/task/%d/stat" % (pid, tid)).rpartition(b")")[2][1:2]
                busy = state in (b"R", b"D")
            todo.extend(int(c) for c in read_proc("/proc/%d/task/%d/children" % (pid, tid)).split())
    return busy or seen >= cap, ticks / _TICKS  # a big tree: assume it computes


def slot_level(pids):
    """``(host_pid, ns_pid, ns_sid, start_ticks)`` of ``pids`` as seen in the slot's PID
    namespace (one level below ours); processes of our own namespace (the outer bwrap)
    are left out."""
    out = []
    for pid in pids:
        status = read_proc("/proc/%d/status" % pid)
        stat = read_proc("/proc/%d/stat" % pid).rpartition(b")")[2].split()
        nspid = nssid = None
        for line in status.splitlines():
            if line.startswith(b"NSpid:"):
                nspid = line.split()[1:]
            elif line.startswith(b"NSsid:"):
                nssid = line.split()[1:]
        if not nspid or len(nspid) < 2 or len(stat) < 20:
            continue  # gone, or not inside the slot's namespace
        out.append((pid, int(nspid[1]), int(nssid[1]) if nssid and len(nssid) > 1 else None,
                    int(stat[19])))
    return out


def read_proc(path):
    """A small /proc file's bytes, or b"" if the process is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        return os.read(fd, 4096)
    except OSError:
        return b""
    finally:
        os.close(fd)
