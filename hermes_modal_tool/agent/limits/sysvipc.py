"""System V IPC objects of a slot's uid, for slots without an IPC namespace of their own.

Stdlib-only, Python 3.8 (``ctypes`` for ``shmctl``/``semctl``/``msgctl``).

With bubblewrap each slot has its own IPC namespace (``--unshare-ipc``): its shared memory
segments, semaphore sets and message queues vanish with it. Without bubblewrap (Modal
images without it) slots share the sandbox's, and an object outlives the processes that
made it: a segment keeps its memory, and the next tenant of the same uid could attach it.
So a release removes every object the slot's uid owns or created (:func:`remove_owned_by`,
from :func:`.isolation.purge_uid`), and the memory watch counts the uid's segments
(:func:`shm_bytes`, see :mod:`.shmwatch`).
"""

import ctypes

IPC_RMID = 0
_KINDS = (("shm", "shmid", "shmctl"), ("sem", "semid", "semctl"), ("msg", "msqid", "msgctl"))


def _table(kind):
    """Rows of ``/proc/sysvipc/<kind>`` as dicts of ints (columns named by its header);
    empty where the file cannot be read."""
    try:
        with open("/proc/sysvipc/" + kind) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    if not lines:
        return []
    names = lines[0].split()
    rows = []
    for line in lines[1:]:
        values = line.split()
        if len(values) != len(names):
            continue
        try:
            rows.append({names[k]: int(v) for k, v in enumerate(values)})
        except ValueError:
            continue
    return rows


def shm_bytes(uids):
    """``{uid: bytes}`` of the System V shared memory segments of ``uids`` (owner or
    creator): resident bytes where the kernel says (``rss``), else their size."""
    out = {}
    for row in _table("shm"):
        owner = row.get("uid") if row.get("uid") in uids else row.get("cuid")
        if owner in uids:
            out[owner] = out.get(owner, 0) + row.get("rss", row.get("size", 0))
    return out


def total_shm_bytes():
    """Bytes of every System V shared memory segment the sandbox sees."""
    return sum(row.get("rss", row.get("size", 0)) for row in _table("shm"))


def remove_owned_by(uid):
    """Remove every segment, semaphore set and message queue that ``uid`` owns or
    created (``IPC_RMID``; a segment still attached goes when its last user detaches:
    the caller kills those first). Returns how many were removed. Needs root for
    objects of other uids; blocking."""
    libc = ctypes.CDLL(None, use_errno=True)
    removed = 0
    for kind, id_column, call in _KINDS:
        fn = getattr(libc, call)
        for row in _table(kind):
            if uid not in (row.get("uid"), row.get("cuid")) or id_column not in row:
                continue
            ident = ctypes.c_int(row[id_column])
            if kind == "sem":  # semctl(semid, semnum, cmd)
                done = fn(ident, ctypes.c_int(0), ctypes.c_int(IPC_RMID))
            else:  # shmctl / msgctl(id, cmd, buf)
                done = fn(ident, ctypes.c_int(IPC_RMID), None)
            if done == 0:
                removed += 1
    return removed
