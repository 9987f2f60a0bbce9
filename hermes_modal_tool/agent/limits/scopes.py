"""Kernel scopes each slot's processes get beyond their namespaces and credentials.

- A new, empty **session keyring** (bwrap does not make one, unlike runc): without it a
  slot would share the keys of the session that started the backend (an ssh login's or
  a systemd service's) and those of other slots.
- A **Landlock domain scoped for abstract UNIX sockets** (Linux 6.12+, Landlock ABI 6):
  abstract sockets belong to a network namespace, so with ``network: true`` (the host's
  network namespace) a slot could otherwise connect to the host's abstract sockets
  (D-Bus, X11, a debugger) and to another slot's. In its own domain it can only reach
  abstract sockets that processes of the same domain (its own shell's) created. Each
  shell start enters a new domain, so two slots never share one. Nothing else is
  restricted (no file system or network access rights are handled).

Everything here is stdlib-only (it runs inside images we do not control) and the
functions returned run between fork and exec, so they only make syscalls.
"""

import ctypes
import os
import struct

#: ``keyctl(2)`` by machine (not wrapped by Python); None where unknown.
_SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "i386": 288, "i686": 288, "armv7l": 311,
               "ppc64le": 271, "s390x": 280, "riscv64": 219}
KEYCTL_JOIN_SESSION_KEYRING = 1
#: Landlock's syscalls have one number on every architecture (asm-generic).
SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET = 1
PR_SET_NO_NEW_PRIVS = 38

_SCOPE = []  # [(ruleset fd or None, what status says)], made once per agent process


def _libc():
    from ..fs.mounts import libc

    return libc()


def keyctl():
    """A callable ``keyctl(op, arg)`` via libc's ``syscall``, loaded before any fork."""
    number = _SYS_KEYCTL.get(os.uname().machine)
    if number is None:
        return None
    syscall = _libc().syscall
    return lambda op, arg: syscall(number, op, arg)


def abstract_socket_scope():
    """``(ruleset_fd, description)``: a Landlock ruleset that scopes abstract UNIX sockets,
    or ``(None, why not)`` where the kernel lacks it (before Linux 6.12, or Landlock not
    enabled). Made once per process; the description is what ``get_status()`` shows."""
    if not _SCOPE:
        syscall = _libc().syscall
        abi = syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                      ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
        if abi < 6:
            why = ("Landlock is not enabled in this kernel" if abi < 0 else
                   "Landlock ABI %d has no scopes (needs 6, Linux 6.12)" % abi)
            _SCOPE.append((None, "shared with the host's network namespace (%s)" % why))
        else:
            attr = ctypes.create_string_buffer(struct.pack("=QQQ", 0, 0, LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET))
            fd = syscall(SYS_LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(len(attr.raw)),
                         ctypes.c_uint32(0))
            if fd < 0:
                err = ctypes.get_errno()
                _SCOPE.append((None, "shared (Landlock refused the ruleset: %s)" % os.strerror(err)))
            else:
                _SCOPE.append((fd, "scoped to the slot (Landlock domain per shell)"))
    return _SCOPE[0]


def enter_scope_fn(privileged):
    """A function for the child between fork and exec that puts it in a new Landlock
    domain (see the module docstring), or None where the kernel cannot.

    ``privileged``: the child still has CAP_SYS_ADMIN when it runs (the agent runs as
    root and the child drops to the slot's uid afterwards); otherwise it sets
    ``no_new_privs`` first, as Landlock requires (bubblewrap is then not setuid).

    Raises OSError in the child if the kernel refuses; the shell does not start then.
    """
    fd, _ = abstract_socket_scope()
    if fd is None:
        return None
    lib = _libc()

    def enter():
        if not privileged and lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if lib.syscall(SYS_LANDLOCK_RESTRICT_SELF, fd, ctypes.c_uint32(0)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, "landlock_restrict_self: %s" % os.strerror(err))

    return enter
