"""Network namespaces for the agent's threads and children (part of :mod:`.slotnet`).

Stdlib-only, Python 3.8. A namespace is made by ``unshare(CLONE_NEWNET)`` in a
throwaway thread and held by a descriptor; a thread enters one for a ``with`` block
(:func:`entered`, which checks the namespace's inode before the block runs), and a
child enters one before exec (:func:`run_in`: a child anywhere else exits
:data:`WRONG_NAMESPACE` without running anything). Sockets made inside belong to that
namespace for their whole life (:mod:`.rtnl`, :mod:`.nftlib`).
"""

import contextlib
import ctypes
import os
import signal
import subprocess
import threading

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
#: Exit status of a command that did not find itself in the namespace it was meant for.
WRONG_NAMESPACE = 121
TOOL_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
_libc = ctypes.CDLL(None, use_errno=True)


class NetError(RuntimeError):
    """Raised when a slot's network cannot be set up (a tool missing, a command failed)."""


def new_netns():
    """A new network namespace (owned by the caller's user namespace), made in a
    throwaway thread; returns ``(fd, inode)``, the descriptor holding it.

    Raises:
        OSError: the kernel refused (no ``CAP_SYS_ADMIN``, namespaces disabled).
    """
    out = []

    def make():
        try:
            if _libc.unshare(CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
            fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            out.append((fd, os.fstat(fd).st_ino))
        except OSError as exc:
            out.append(exc)

    thread = threading.Thread(target=make, name="hmt-netns")
    thread.start()
    thread.join()
    if isinstance(out[0], OSError):
        raise out[0]
    return out[0]


def own_inode():
    return os.stat("/proc/thread-self/ns/net").st_ino


@contextlib.contextmanager
def entered(fd, inode):
    """Move the calling thread into the namespace held by ``fd`` (inode ``inode``) for
    the ``with`` block, and back. Threads it starts meanwhile stay in that namespace.

    Raises:
        OSError: ``setns`` failed, or the thread is not in the namespace after it.
    """
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNET)")
        try:
            if own_inode() != inode:
                raise OSError("setns left the thread outside the namespace %d" % inode)
            yield
        finally:
            if _libc.setns(home, CLONE_NEWNET) != 0:  # pragma: no cover - it let us in
                raise OSError(ctypes.get_errno(), "setns back to the agent's namespace")
    finally:
        os.close(home)


def run_in(fd, inode, argv, text=None, timeout=15):
    """Run ``argv`` in the namespace held by ``fd`` (inode ``inode``); returns its stdout.

    The child enters the namespace and checks its inode before exec: a child that is
    anywhere else exits :data:`WRONG_NAMESPACE` without running ``argv``.

    Raises:
        NetError: the command failed (its stderr in the message).
    """
    def enter():
        if _libc.setns(fd, CLONE_NEWNET) != 0 or os.stat("/proc/self/ns/net").st_ino != inode:
            os._exit(WRONG_NAMESPACE)

    proc = subprocess.run(argv, input=text, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, preexec_fn=enter, timeout=timeout,
                          env={"PATH": TOOL_PATH})
    if proc.returncode != 0:
        raise NetError("%s failed (%d)%s: %s" % (
            " ".join(argv[:4]), proc.returncode,
            " (not in its namespace)" if proc.returncode == WRONG_NAMESPACE else "",
            proc.stderr.strip()[-500:]))
    return proc.stdout


def pdeathsig():
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
