"""Starting a layered-root slot's bwrap from a thread of the agent: no process is copied.

Stdlib-only, Python 3.8 (the start itself needs 3.10+, see below; ``ctypes`` for the
syscalls).

Why: the spawner (:mod:`.spawner`) clones a Python process for every shell start. The
clone of its address space, the copy-on-write faults while the child joins the slot and
the teardown of that copy at ``execve`` cost about 2.7 ms of machine CPU per start
(``perf`` over back-to-back acquire + command + release cycles, benchmarks/engine.py
section c): the largest part of such a cycle that was ours to remove.

How: Linux keeps per *thread* every setting the child made before its exec:

- the mount namespace and working directory (once the thread has ``unshare(CLONE_FS)``);
- cgroup v1 membership (a thread id written to a ``tasks`` file moves that thread only);
- credentials: the raw ``setgroups``/``setresgid``/``setresuid`` syscalls (glibc's
  wrappers would change every thread of the agent);
- the Landlock domain and the session keyring (both live in the thread's credentials).

So a new thread takes on the slot's settings (:mod:`.isolation` ``slot_entry_fn`` makes
the same ones in a forked child), then ``subprocess.Popen`` starts bwrap with ``vfork``
(Python 3.10+; nothing is copied, and CPython's child runs no Python), and bwrap inherits
them. The thread leaves the slot's cgroups at once, through descriptors of the agent's
own ``tasks`` files opened while it was root. It keeps its dropped credentials and stays
until bwrap has exited, because bwrap's ``--die-with-parent`` (``PR_SET_PDEATHSIG``) fires
when the *thread* that started it ends. Its name in ``/proc`` (``comm``) is
``hmt-start-<slot>``.

Where: bubblewrap isolation (a slot's processes are in a PID namespace of their own and
cannot name the agent's threads to signal them), cgroup v1, no rlimits to set (rlimits
are per process, and ``Popen`` cannot set them for the child), Python 3.10+ with
``vfork``, an architecture whose syscall numbers are known here, and the spawner's clean
mount namespace. Elsewhere shells start through the spawner, or with ``Popen`` and
``preexec_fn``, as before: :func:`for_agent` says which and why.
"""

import ctypes
import errno
import os
import subprocess
import sys
import threading

from ..fs import mounts
from ..limits import cgroups, scopes

#: ``(setgroups, setresgid, setresuid)`` syscall numbers by machine.
_SYS_IDS = {"x86_64": (116, 119, 117), "aarch64": (159, 149, 147)}
CLONE_FS = 0x00000200
PR_SET_NAME = 15
V1_CONTROLLERS = ("memory", "pids", "cpu")
_MAKING = threading.Lock()


def for_agent(agent):
    """The agent's :class:`ThreadStarter`, made on first use; None where shells cannot
    start this way (``agent.thread_start_note`` says why). Blocking (its first call asks
    the spawner for its mount namespace): call it from a worker thread."""
    with _MAKING:
        if agent.thread_start_note is None:
            _make(agent)
    starter = agent.thread_starter
    return starter if starter is not None and not starter.broken else None


def _make(agent):
    starter = None
    why = _unusable(agent)
    if why is None:
        fds = []
        try:
            # cpuacct too where it is mounted on its own (the usage ledger's CPU, usage.py):
            # a thread that joined a slot's cpuacct cgroup must leave it as well.
            ctrls = V1_CONTROLLERS + tuple(c for c in cgroups.Cgroups.OPTIONAL
                                           if c in agent.cgroups.v1_controllers())
            fds = _own_tasks_fds(ctrls)
            _check_thread_moves(agent.cgroups.sandbox_files("tasks"), fds, ctrls)
            starter = ThreadStarter(_start_namespace(agent.spawner.mount_namespace()), fds)
        except OSError as exc:
            why = "%s" % (exc,)
            for fd in fds:
                os.close(fd)
    agent.thread_starter = starter
    agent.thread_start_note = ("from a thread of the agent (vfork)" if starter is not None
                               else "through the spawner (%s)" % why)


def _unusable(agent):
    """Why shells of this agent cannot start from a thread, or None."""
    if agent.isolation != "bwrap":
        return "no bubblewrap"
    if agent.cgroups is None or agent.cgroups.mode != "cgroup-v1":
        return "needs cgroup v1"
    if sys.version_info < (3, 10) or not getattr(subprocess, "_USE_VFORK", True):
        return "Python %d.%d has no vfork start" % sys.version_info[:2]
    if os.uname().machine not in _SYS_IDS:
        return "syscall numbers unknown on %s" % os.uname().machine
    if agent.spawner is None or agent.spawner.broken:
        return "no spawner for a clean mount namespace"
    return None


def _enter_copy(lib, mntns_fd):
    """Move the calling thread (alone) into a new copy of the mount namespace ``mntns_fd``."""
    for result, what in ((lambda: lib.unshare(CLONE_FS), "unshare(CLONE_FS)"),
                         (lambda: lib.setns(mntns_fd, mounts.CLONE_NEWNS), "setns(mnt)"),
                         (lambda: lib.unshare(mounts.CLONE_NEWNS), "unshare(CLONE_NEWNS)")):
        if result() != 0:
            err = ctypes.get_errno()
            raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def _start_namespace(spawner_ns):
    """The mount namespace every start copies: the spawner's (the sandbox's own mounts,
    no slot's), without ``/sys`` and the mounts below it (a dozen cgroup hierarchies with
    cgroup v1, which bwrap does not use). bwrap reads ``/proc/self/mountinfo`` after each
    of its bind mounts, about nine times per start, and each read costs in proportion to
    the mounts there. Made in a thread of its own, which then ends; returns its fd and
    closes ``spawner_ns``."""
    out = []

    def run():
        try:
            lib = mounts.libc()
            _enter_copy(lib, spawner_ns)
            if lib.umount2(b"/sys", mounts.MNT_DETACH) != 0 and ctypes.get_errno() != errno.EINVAL:
                err = ctypes.get_errno()
                raise OSError(err, "umount /sys: %s" % os.strerror(err))
            out.append(os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC))
        except BaseException as exc:  # noqa: BLE001 - raised below
            out.append(exc)

    try:
        thread = threading.Thread(target=run, name="hmt-start-ns", daemon=True)
        thread.start()
        thread.join()
    finally:
        os.close(spawner_ns)
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _check_thread_moves(tasks_files, own_fds, ctrls=V1_CONTROLLERS):
    """Check once, with the sandbox's own cgroups (``tasks_files``), that a thread moves
    alone, as Linux moves it, and moves back through ``own_fds``: a kernel that moved
    the whole agent (a reimplementation of cgroups, say) would put it in a slot's cgroups
    at every start. Raises OSError when it does not."""
    out = []

    def lines(path):
        with open(path) as fh:
            return sorted(line for line in fh.read().splitlines()
                          if set(line.split(":", 2)[1].split(",")) & set(ctrls))

    def run():
        try:
            tid = threading.get_native_id()
            main = lines("/proc/self/task/%d/cgroup" % os.getpid())
            for path in tasks_files:
                with open(path, "w") as fh:
                    fh.write(str(tid))
            moved = lines("/proc/thread-self/cgroup")
            stayed = lines("/proc/self/task/%d/cgroup" % os.getpid()) == main
            for fd in own_fds:
                os.write(fd, str(tid).encode())
            back = lines("/proc/thread-self/cgroup") == main
            out.append(moved != main and stayed and back)
        except BaseException as exc:  # noqa: BLE001 - raised below
            out.append(exc)

    thread = threading.Thread(target=run, name="hmt-start-chk", daemon=True)
    thread.start()
    thread.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    if not out[0]:
        raise OSError(errno.EPERM, "a thread does not join a cgroup v1 alone here")


def _own_tasks_fds(ctrls=V1_CONTROLLERS):
    """Write descriptors of the agent's own cgroup v1 ``tasks`` files (memory, pids,
    cpu): a thread writes its id there to leave a slot's cgroups, with any credentials.
    Raises OSError when one is not where ``/proc/self/cgroup`` says."""
    where = cgroups._cgroup_mounts()["v1"]
    fds = []
    try:
        with open("/proc/self/cgroup") as fh:
            lines = fh.read().splitlines()
        for ctrl in ctrls:
            path = next((line.split(":", 2)[2] for line in lines
                         if ctrl in line.split(":", 2)[1].split(",")), None)
            if path is None or ctrl not in where:
                raise OSError(errno.ENOENT, "the agent's own %s cgroup is unknown" % ctrl)
            tasks = os.path.join(where[ctrl], path.lstrip("/"), "tasks")
            with open(tasks) as fh:
                if str(os.getpid()) not in fh.read().split():
                    raise OSError(errno.ENOENT, "the agent is not in %s" % tasks)
            fds.append(os.open(tasks, os.O_WRONLY | os.O_CLOEXEC))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


class ThreadStarter:
    """Starts slot shells from new threads of the agent (see the module docstring).

    ``mntns_fd``: the clean mount namespace each start copies; ``own_tasks_fds``: the
    agent's own cgroup v1 ``tasks`` files, open for writing."""

    def __init__(self, mntns_fd, own_tasks_fds):
        self.mntns_fd = mntns_fd
        self.own_tasks_fds = own_tasks_fds
        self.ids = _SYS_IDS[os.uname().machine]
        self.lib = mounts.libc()
        self.keyctl = scopes.keyctl()
        self.enter_scope = scopes.enter_scope_fn(privileged=True)
        self.broken = None  # why a start failed here; later ones go through the spawner

    def start(self, name, argv, env, stdio, pass_fds, tasks_files, uid, gid, tree, tree_at,
              on_thread=None):
        """Start ``argv`` (bwrap) with the slot's settings; return its ``Popen``.

        ``name``: the thread's name (``comm``, at most 15 bytes kept); ``stdio``: three
        descriptors for its 0, 1, 2; ``pass_fds``: descriptors it keeps at their numbers;
        ``tasks_files``: the slot's cgroup v1 ``tasks`` files; ``uid``/``gid``: the slot's
        ids; ``tree``: a detached mount (``mounts.clone_tree``) attached at ``tree_at`` in
        the child's own mount namespace; ``on_thread(tid)`` is called in the new thread
        first. Blocks until bwrap has exec'd or the start failed.

        Raises OSError (which step failed, and why) or RuntimeError (no thread could be
        made); nothing was started then and the descriptors are as they were.
        """
        out = []
        done = threading.Event()

        def run():
            proc = self._run(name, argv, env, stdio, pass_fds, tasks_files, uid, gid, tree,
                             tree_at, on_thread, out, done)
            if proc is not None:  # until bwrap has exited (and not reaped: the agent reaps)
                try:
                    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
                except OSError:
                    pass  # reaped by the agent meanwhile

        threading.Thread(target=run, name=name, daemon=True).start()
        done.wait()
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    def _run(self, name, argv, env, stdio, pass_fds, tasks_files, uid, gid, tree, tree_at,
             on_thread, out, done):
        """The new thread's part: settings, ``Popen``, leaving the slot's cgroups. The
        result (``Popen`` or the exception) goes to ``out``; returns the ``Popen``."""
        tid = threading.get_native_id()
        joined = False
        proc = None
        try:
            self.lib.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
            if on_thread is not None:
                on_thread(tid)
            for path in tasks_files:  # by path: the start's namespace has no /sys
                joined = True
                mounts.write_control(path, b"%d" % tid)
            _enter_copy(self.lib, self.mntns_fd)
            mounts.move_mount_fd(tree, tree_at)
            if self.enter_scope is not None:
                self.enter_scope()
            if uid is not None:
                setgroups, setresgid, setresuid = self.ids
                self._check(self.lib.syscall(setgroups, 0, None), "setgroups")
                self._check(self.lib.syscall(setresgid, gid, gid, gid), "setresgid")
                self._check(self.lib.syscall(setresuid, uid, uid, uid), "setresuid")
            if self.keyctl is not None:
                self.keyctl(scopes.KEYCTL_JOIN_SESSION_KEYRING, None)
            proc = subprocess.Popen(argv, stdin=stdio[0], stdout=stdio[1], stderr=stdio[2],
                                    env=env, cwd="/", pass_fds=pass_fds, close_fds=True)
            out.append(proc)
        except BaseException as exc:  # noqa: BLE001 - the caller raises it
            out.append(exc)
        finally:
            try:
                if joined:
                    self._leave(tid)
            finally:
                done.set()  # whatever happened: the caller must not wait forever
        return proc

    def _leave(self, tid):
        """Move this thread back to the agent's own cgroups (allowed with the slot's
        credentials: a task may move itself through a descriptor opened by root)."""
        for fd in self.own_tasks_fds:
            try:
                os.write(fd, b"%d" % tid)
            except OSError:
                pass  # it stays there until it ends; kill_slot never signals the agent

    def _check(self, result, what):
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, "%s: %s" % (what, os.strerror(err)))
