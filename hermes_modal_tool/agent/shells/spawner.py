"""The spawner: a small process that starts slot shells for the agent.

Stdlib-only, Python 3.8 (``ctypes`` for ``clone``, ``unshare`` and ``move_mount``).

Why: a shell start used to be ``Popen(bwrap ...)`` from the agent, with the uid drop,
cgroup join, rlimits, Landlock scope and session keyring in ``preexec_fn``. That is a
Python ``fork`` of the whole agent (40-80 MB with many slots: 4-8 ms of page-table copy
and copy-on-write faults per start, against 0.8 ms for a ``vfork``). And bwrap, started in
the agent's mount namespace, copied, parsed (``/proc/self/mountinfo``, about nine times
per start) and detached every mount of every slot: with 100 slots, hundreds of overlay
mounts, most of a start's CPU (see ``benchmarks/engine.py`` section f).

How: :func:`start` forks the spawner from the agent first thing, while the agent is small
(no slot, no thread). The spawner moves into a mount namespace of its own (a private copy
of the sandbox's, taken before any slot mount exists) and serves requests on a
``SOCK_SEQPACKET`` pair. For each shell it ``clone``\\ s a child with ``CLONE_PARENT``, so
the shell is the *agent's* child (the agent waits for it as it did for ``Popen``); the
child enters a new mount namespace of its own, attaches there the slot's root (a detached
copy of its overlay, ``open_tree(OPEN_TREE_CLONE)``, passed as a descriptor) at the same
path as in the agent, joins the slot's cgroups, sets rlimits, enters a new Landlock domain,
drops to the slot's uid, joins a new session keyring and execs bwrap, which then sees a
few dozen mounts instead of every slot's.

Where a new thread of the agent can take on a slot's settings itself (:mod:`.threadstart`:
cgroup v1, Python 3.10+), shells start from there instead, with no process copied; the
spawner then lends them its mount namespace. It makes the user namespaces of idmapped
mounts only where the agent cannot make them with a child that shares its memory
(:func:`.mounts.userns_fd`).

Where the spawner cannot run (not root, no ``clone`` number for this machine, a kernel
without ``move_mount``), :func:`start` returns None or the first failed start marks it
broken, and shells start with ``Popen`` as before.
"""

import array
import ctypes
import errno
import fcntl
import marshal
import os
import queue
import select
import signal
import socket
import subprocess
import threading
import time

from ..fs import mounts
from ..limits import isolation, scopes

#: ``clone(2)`` by machine (its first argument is the flags on both).
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}
CLONE_PARENT = 0x00008000
PR_SET_PDEATHSIG = 1
#: The descriptor number of the first ``pass_fds`` entry in the started process (0-2 are
#: its stdio); callers name it in the argv (bwrap's ``--info-fd``).
FIRST_PASS_FD = 3
#: Bound on one start inside the spawner (from clone to exec), seconds: a child stuck
#: joining a cgroup is killed and the start fails, so the spawner never hangs.
EXEC_TIMEOUT_S = 30.0
#: Connections to the spawner: as many starts may be under way at once (the agent's
#: "spawn" threads, plus one for user namespaces of roots being built meanwhile).
CHANNELS = 6
_MAX_FDS = 8
_MSG = 1 << 20


def start():
    """Fork the spawner; return a :class:`Spawner` (its first request finds out whether it
    could set itself up), or None where it cannot work at all: the agent is not root, or
    ``clone``'s number on this machine is unknown. Call before the agent starts threads."""
    number = _SYS_CLONE.get(os.uname().machine)
    if os.geteuid() != 0 or number is None:
        return None
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(CHANNELS)]
    why_r, why_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the spawner process
        code = 1
        try:
            for ours, _ in pairs:
                ours.close()
            os.close(why_r)
            code = _serve([theirs for _, theirs in pairs], why_w, number)
        finally:
            os._exit(code)
    for _, theirs in pairs:
        theirs.close()
    os.close(why_w)
    return Spawner([ours for ours, _ in pairs], why_r)


class Spawner:
    """The agent's handle on the spawner process: :data:`CHANNELS` connections, each
    with at most one request in flight, so that starts from several threads overlap
    (a start waits milliseconds in the kernel, joining cgroups, for almost no CPU)."""

    def __init__(self, socks, why_fd):
        self.channels = queue.Queue()
        for sock in socks:
            sock.settimeout(EXEC_TIMEOUT_S + 10.0)
            self.channels.put(sock)
        self.broken = None  # why it stopped answering, once it did
        self._why_fd = why_fd  # why it stopped at its start, if it did (read once)
        self._why_lock = threading.Lock()

    def _gone(self, what):
        """Mark the spawner gone; its own reason when it gave one at its start."""
        why = None
        with self._why_lock:
            if self._why_fd is not None:
                try:
                    why = _read_all(self._why_fd).decode("utf-8", "replace")
                finally:
                    os.close(self._why_fd)
                    self._why_fd = None
        self.broken = self.broken or why or what
        return OSError(errno.EPIPE, "the spawner is gone: %s" % self.broken)

    def spawn(self, argv, env, cwd, stdio, pass_fds, setup, tree=None):
        """Start ``argv`` (``argv[0]`` an absolute path) as a child of the agent.

        ``stdio``: three descriptors for its 0, 1, 2; ``pass_fds``: descriptors it gets as
        :data:`FIRST_PASS_FD` and up; ``setup``: dict with ``procs_files`` (cgroup files
        to join), ``rlimits`` (``[(resource, value)]``), ``uid``/``gid`` (None: keep
        root); ``tree``: ``(fd, path)``, a detached mount attached at
        ``path`` in the child's own mount namespace. Returns a :class:`SpawnedProcess`.

        Raises OSError when the start failed (the message says which step and why) or
        when the spawner is gone (``broken`` says why; start with ``Popen`` then).
        """
        fds = list(stdio) + list(pass_fds) + ([tree[0]] if tree else [])
        msg = marshal.dumps(("start", list(argv), dict(env), cwd, len(pass_fds), dict(setup),
                             tree[1] if tree else None))
        (pid, error), _ = self._ask(msg, fds)
        if error:
            if pid:
                SpawnedProcess(pid).wait()  # it exited before its exec: reap it
            raise OSError(errno.ECHILD, error)
        return SpawnedProcess(pid)

    def userns(self, uid, gid, inside=0):
        """:func:`.mounts.userns_fd` made by the spawner (where the agent has no shared
        child: a fork of the small spawner is cheaper than one of the agent);
        returns the namespace fd. Raises OSError as that does, or with ``EPIPE`` when
        the spawner is gone."""
        (_, error), fds = self._ask(marshal.dumps(("userns", uid, gid, inside)), [])
        if error or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise OSError(errno.EPERM, error or "the spawner sent no namespace")
        return fds[0]

    def mount_namespace(self):
        """An fd of the spawner's mount namespace (the sandbox's mounts, no slot's; see
        :mod:`.threadstart`). Raises OSError as :meth:`userns` does."""
        (_, error), fds = self._ask(marshal.dumps(("mntns",)), [])
        if error or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise OSError(errno.EPERM, error or "the spawner sent no namespace")
        return fds[0]

    def _ask(self, msg, fds):
        """Send one request on a free channel; return ``(reply, received fds)``."""
        if self.broken:
            raise OSError(errno.EPIPE, "the spawner is gone: %s" % self.broken)
        sock = self.channels.get()
        try:
            _send(sock, msg, fds)
            reply, got = _recv_fds(sock)[:2]
        except OSError as exc:
            raise self._gone("%s" % (exc,)) from exc
        finally:
            self.channels.put(sock)
        if not reply:
            raise self._gone("it exited")
        return marshal.loads(reply), got


class SpawnedProcess:
    """A child of the agent started by the spawner: the parts of ``subprocess.Popen``
    the agent uses (``pid``, ``returncode``, ``poll``, ``wait``)."""

    def __init__(self, pid):
        self.pid = pid
        self.returncode = None
        self._lock = threading.Lock()

    def poll(self):
        return self._try_wait(os.WNOHANG)

    def _try_wait(self, flags):
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, flags)
                except ChildProcessError:
                    self.returncode = 255  # reaped elsewhere: unknown
                    return self.returncode
                if pid == self.pid:
                    self.returncode = (-os.WTERMSIG(status) if os.WIFSIGNALED(status)
                                       else os.WEXITSTATUS(status))
            return self.returncode

    def wait(self, timeout=None):
        """The exit code (negative: the signal); raises ``subprocess.TimeoutExpired``
        after ``timeout`` seconds (None: wait as long as it runs)."""
        if timeout is None:
            return self._try_wait(0)
        end = time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            left = end - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.05)
        return self.returncode


# -- the spawner process -------------------------------------------------------------
def _read_all(fd):
    out = b""
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            return out
        out += chunk


def _serve(socks, why_w, number):  # pragma: no cover - runs in the spawner process
    """The spawner's life: at its first request, a mount namespace of its own (a copy of
    the sandbox's, which the agent's slot mounts are never in: the agent has a namespace
    of its own); then requests from every channel, a start answered when its child has
    exec'd (or failed), others served meanwhile. Setting up at the first request keeps
    it out of the agent's own start. A failure is written to ``why_w`` before it exits."""
    lib = mounts.libc()
    try:
        lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        keep = {sock.fileno() for sock in socks} | {why_w}
        for fd in _open_fds():
            if fd > 2 and fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1):
            os.dup2(devnull, fd)
        os.close(devnull)
        select.select(socks, [], [])  # the first request
        mounts.enter_private_mount_namespace()
        del scopes._SCOPE[:]  # a ruleset made before the fork was closed above
        clone = ctypes.PyDLL(None, use_errno=True).syscall  # keeps the GIL over the call
        clone.restype = ctypes.c_long
        enter_slot = isolation.slot_entry_fn(privileged=True)
    except Exception as exc:  # noqa: BLE001 - reported to the agent, which falls back
        os.write(why_w, ("spawner: %s" % (exc,)).encode())
        return 1
    os.close(why_w)
    idle = {sock.fileno(): sock for sock in socks}
    starting = {}  # error pipe fd -> [channel, pid, error bytes, deadline]
    while idle or starting:
        now = time.monotonic()
        ends = [e[3] for e in starting.values() if e[3] != float("inf")]
        wait = max(0.0, min(ends) - now) if ends else None
        try:
            ready = select.select(list(idle) + list(starting), [], [], wait)[0]
        except InterruptedError:
            continue
        for fd in ready:
            if fd in idle:
                sock = idle.pop(fd)
                pending = _serve_one(sock, clone, number, enter_slot)
                if pending is None:
                    idle[fd] = sock
                elif pending is not False:
                    starting[pending[0]] = [sock, pending[1], b"", time.monotonic() + EXEC_TIMEOUT_S]
            else:
                entry = starting[fd]
                try:
                    chunk = os.read(fd, 4096)
                except OSError:
                    chunk = b""
                if chunk:
                    entry[2] += chunk
                    continue
                del starting[fd]
                os.close(fd)
                if _reply(entry[0], (entry[1], entry[2].decode("utf-8", "replace")), []):
                    idle[entry[0].fileno()] = entry[0]
        for entry in list(starting.values()):
            if time.monotonic() >= entry[3]:
                try:
                    os.kill(entry[1], signal.SIGKILL)
                except OSError:
                    pass
                entry[2] = b"the start did not reach exec within %gs (killed)" % EXEC_TIMEOUT_S
                entry[3] = float("inf")  # its pipe closes as it dies: answered then
    return 0


def _serve_one(sock, clone, number, enter_slot):  # pragma: no cover
    """Take one request from ``sock``: None when answered, ``(error pipe, pid)`` for a
    start under way, False when the channel is closed."""
    try:
        msg, fds, _, _ = _recv_fds(sock)
    except OSError:
        return False
    if not msg:
        return False
    out_fds = []
    try:
        request = marshal.loads(msg)
        if request[0] == "userns":
            out_fds.append(mounts.userns_fd(*request[1:]))
            reply = (0, "")
        elif request[0] == "mntns":
            out_fds.append(os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC))
            reply = (0, "")
        else:
            started = _start_one(request[1:], fds, clone, number, enter_slot)
            if isinstance(started[1], int):
                return started  # answered once the child has exec'd
            reply = started
    except Exception as exc:  # noqa: BLE001 - the request fails, the spawner lives on
        reply = (0, "spawner: %s: %s" % (type(exc).__name__, exc))
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
    try:
        return None if _reply(sock, reply, out_fds) else False
    finally:
        for fd in out_fds:
            os.close(fd)


def _reply(sock, reply, fds):  # pragma: no cover - runs in the spawner process
    try:
        _send(sock, marshal.dumps(reply), fds)
        return True
    except OSError:
        return False


def _send(sock, data, fds):
    """One message, with ``fds`` (passed as ``SCM_RIGHTS``) when there are any."""
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def _recv_fds(sock):
    """``socket.recv_fds`` (Python 3.9+) with close-on-exec descriptors, on 3.8 too."""
    size = socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)
    msg, anc, flags, addr = sock.recvmsg(_MSG, size, socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - (len(data) % fds.itemsize)])
    return msg, list(fds), flags, addr


def _open_fds():
    try:
        return [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 256))


def _start_one(request, fds, clone, number, enter_slot):  # pragma: no cover
    """Clone the child for a start; ``(error pipe, pid)`` (the pipe's end in the child
    closes at exec or carries its error), or ``(0, error text)``."""
    argv, env, cwd, n_pass, setup, tree_at = request
    if len(fds) != 3 + n_pass + (1 if tree_at else 0):
        return 0, "spawner: expected %d descriptors, got %d" % (3 + n_pass, len(fds))
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    null = ctypes.c_long(0)
    pid = clone(ctypes.c_long(number), ctypes.c_long(CLONE_PARENT | signal.SIGCHLD), null, null, null, null)
    if pid == 0:
        try:
            _child(argv, env, cwd, fds, n_pass, setup, tree_at, enter_slot)
        except BaseException as exc:  # noqa: BLE001 - told to the agent, then exit
            try:
                os.write(err_w, ("%s" % (exc,)).encode("utf-8", "replace")[:4000] or b"failed")
            finally:
                os._exit(127)
        os._exit(127)
    os.close(err_w)
    if pid < 0:
        os.close(err_r)
        return 0, "clone: %s" % os.strerror(ctypes.get_errno())
    return err_r, pid


def _child(argv, env, cwd, fds, n_pass, setup, tree_at, enter_slot):  # pragma: no cover
    """In the clone: the slot's root in a mount namespace of its own, then what
    ``preexec_fn`` does with ``Popen`` (:func:`.isolation.slot_entry_fn`), then exec."""
    lib = mounts.libc()
    if tree_at:
        if lib.unshare(mounts.CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
        mounts.move_mount_fd(fds[-1], tree_at)
    enter_slot(setup.get("procs_files") or (), setup.get("rlimits") or (), setup.get("uid"),
               setup.get("gid"))
    for sig in ("SIGPIPE", "SIGXFZ", "SIGXFSZ"):  # as Popen's restore_signals
        if hasattr(signal, sig):
            signal.signal(getattr(signal, sig), signal.SIG_DFL)
    # Move every received descriptor above the targets, then onto them (dup2 clears
    # close-on-exec on the target only; the rest close at exec).
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3 + n_pass) for fd in fds]
    for target, fd in enumerate(high[:3 + n_pass]):
        os.dup2(fd, target)
    os.chdir(cwd)
    os.execve(argv[0], argv, env)

