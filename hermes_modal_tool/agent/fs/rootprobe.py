"""Can slots get a layered root here (:mod:`.rootfs`)? One test overlay, made once.

Stdlib-only, Python 3.8.
"""

import os

from .mounts import enter_private_mount_namespace, mount_idmapped, mount_overlay, umount, userns_fd
from .trees import remove_tree


def probe(state_dir, known=False):
    """Can slots get a layered root here? Returns ``""`` when they can, else why not.

    Moves the agent into its own mount namespace (which it keeps) and mounts one test
    overlay over an idmapped ``/``, then removes it. ``known``: the driver saw an earlier
    agent on this host and file system pass the test (the local driver remembers it per
    process), so only the namespace is made (~7 ms less per start).
    """
    if os.geteuid() != 0:
        return "the agent is not root (idmapped mounts need CAP_SYS_ADMIN)"
    try:
        enter_private_mount_namespace()
    except OSError as exc:
        return "no private mount namespace: %s" % (exc.strerror or exc,)
    if known:
        return ""
    test = os.path.join(state_dir, "fs-probe")
    lower = os.path.join(test, "lower")
    try:
        for name in ("lower", "upper", "work", "merged"):
            os.makedirs(os.path.join(test, name), exist_ok=True)
        ns = userns_fd(65534, 65534)
        try:
            mount_idmapped("/", lower, ns)
        finally:
            os.close(ns)
        try:
            mount_overlay(lower, os.path.join(test, "upper"), os.path.join(test, "work"),
                          os.path.join(test, "merged"))
            umount(os.path.join(test, "merged"))
        finally:
            umount(lower)
    except OSError as exc:
        return "layered root unavailable: %s" % (exc.strerror or exc,)
    finally:
        _remove_probe(test)
    return ""


def _remove_probe(test):
    for name in ("merged", "lower"):
        try:
            os.rmdir(os.path.join(test, name))
        except OSError:
            pass
    remove_tree(test)
