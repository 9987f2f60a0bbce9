"""A profile's volumes inside the sandbox: one bind mount per volume in each slot.

Stdlib-only, Python 3.8. The host checked the volumes (``hermes_modal_tool/volumes.py``);
the agent takes them from its ``init`` config (the host's, trusted) and adds them to
every slot's bubblewrap command line, after the slot's root and its ``/proc``, ``/dev``
and writable places, so that nothing of the slot's own is mounted over them. A
read-only volume is bound with ``--ro-bind``: besides the flag, the slot's unprivileged
uid outside owns nothing in it, so the kernel refuses its writes even if it remounted
the bind writable in its own user namespace.
"""

import os


def parse(config, other_uids=False):
    """The volumes of an ``init`` config: a list of (source, target, read_only).

    ``other_uids``: the slots run as uids of their own (bubblewrap resolves ``source`` as
    the slot's uid), so every directory on the way must let others through (``o+x``).

    Raises:
        ValueError: a volume that is not an absolute ``source`` directory and an absolute
            ``target``, or (``other_uids``) a source the slots' uids cannot reach.
    """
    out = []
    for vol in config.get("volumes") or ():
        source, target = vol.get("source"), vol.get("target")
        if not (isinstance(source, str) and source.startswith("/")
                and isinstance(target, str) and target.startswith("/") and target != "/"):
            raise ValueError("bad volume %r: needs an absolute source and target" % (vol,))
        if not os.path.isdir(source):
            raise ValueError("volume source %r is not a directory" % (source,))
        if other_uids:
            _reachable(source)
        out.append((source, target, vol.get("read_only", True) is not False))
    return out


def _reachable(source):
    parts = [p for p in source.split("/") if p]
    for i in range(len(parts) + 1):
        path = "/" + "/".join(parts[:i])
        if not os.stat(path).st_mode & 0o001:
            raise ValueError("volume source %r: the slots' uids cannot reach it (%s is not "
                             "searchable by others: chmod o+x, or choose a place that is)"
                             % (source, path))


def argv(volumes):
    """bwrap arguments binding each volume at its target (read-only where it is)."""
    args = []
    for source, target, read_only in volumes:
        args += ["--ro-bind" if read_only else "--bind", source, target]
    return args


def targets(volumes):
    """The volumes' targets (mount points a slot's layered root is given up front)."""
    return [target for _, target, _ in volumes]
