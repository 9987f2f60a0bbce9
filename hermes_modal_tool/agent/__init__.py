"""The in-sandbox agent and how a driver starts it.

A driver runs ``python3 -I -S -c BOOTSTRAP`` in the sandbox (locally, or through
one long-lived Modal ``exec``) and writes :func:`bundle` to its stdin, followed by
protocol frames. The bootstrap reads the bundle (the agent's stdlib-only modules),
installs them under their package names and starts the agent, so no image needs
our code installed: any image with ``python3`` >= 3.8 works. The bootstrap blocks
``ssl`` (``asyncio`` imports it when present): the agent speaks no TLS, and loading
OpenSSL is a few milliseconds of every start.

The agent's rooms, top to bottom; a module imports only from its own room and the
rooms below it (``tests/test_import_graph.py`` checks it)::

    main, calls, setup, slot, heartbeat   the agent process, the call router, init, a slot
       state/    snapshots, forks, snapshots as tar streams
       shells/   spawner, shell start, the shell protocol, output, PTY processes
       limits/   isolation, cgroups, admission, watches, IPC cleanup, usage, caps, GPUs
       files/    the file tools, confined to a slot's workspace
       fs/       mounts, trees, the layered root, the disk limit, tmpfs, wipes, volumes
    hermes_modal_tool.protocol, hermes_modal_tool.deadlines   (shared with the host)

Everything here is stdlib-only and runs on Python 3.8.
"""

from __future__ import annotations

import functools
import json
import marshal
from importlib import resources

# Modules sent into the sandbox, in import order (dependencies first).
_MODULES = (
    ("hermes_modal_tool", None),
    ("hermes_modal_tool.protocol", "protocol.py"),
    ("hermes_modal_tool.deadlines", "deadlines.py"),
    ("hermes_modal_tool.agent", None),
    ("hermes_modal_tool.agent.limits", None),
    ("hermes_modal_tool.agent.limits.scopes", "agent/limits/scopes.py"),
    ("hermes_modal_tool.agent.limits.sysvipc", "agent/limits/sysvipc.py"),
    ("hermes_modal_tool.agent.limits.isolation", "agent/limits/isolation.py"),
    ("hermes_modal_tool.agent.fs", None),
    ("hermes_modal_tool.agent.fs.volumes", "agent/fs/volumes.py"),
    ("hermes_modal_tool.agent.fs.mounts", "agent/fs/mounts.py"),
    ("hermes_modal_tool.agent.limits.cgroupv2", "agent/limits/cgroupv2.py"),
    ("hermes_modal_tool.agent.limits.cgroups", "agent/limits/cgroups.py"),
    ("hermes_modal_tool.agent.shells", None),
    ("hermes_modal_tool.agent.shells.procs", "agent/shells/procs.py"),
    ("hermes_modal_tool.agent.shells.owned", "agent/shells/owned.py"),
    ("hermes_modal_tool.agent.fs.rootplan", "agent/fs/rootplan.py"),
    ("hermes_modal_tool.agent.fs.trees", "agent/fs/trees.py"),
    ("hermes_modal_tool.agent.fs.beneath", "agent/fs/beneath.py"),
    ("hermes_modal_tool.agent.limits.usage", "agent/limits/usage.py"),
    ("hermes_modal_tool.agent.fs.layerspares", "agent/fs/layerspares.py"),
    ("hermes_modal_tool.agent.fs.slotdisk", "agent/fs/slotdisk.py"),
    ("hermes_modal_tool.agent.fs.rootfs", "agent/fs/rootfs.py"),
    ("hermes_modal_tool.agent.fs.rootprobe", "agent/fs/rootprobe.py"),
    ("hermes_modal_tool.agent.fs.slottmpfs", "agent/fs/slottmpfs.py"),
    ("hermes_modal_tool.agent.limits.diskwatch", "agent/limits/diskwatch.py"),
    ("hermes_modal_tool.agent.limits.shmwatch", "agent/limits/shmwatch.py"),
    ("hermes_modal_tool.agent.files", None),
    ("hermes_modal_tool.agent.files.files", "agent/files/files.py"),
    ("hermes_modal_tool.agent.fs.wipes", "agent/fs/wipes.py"),
    ("hermes_modal_tool.agent.files.filetools", "agent/files/filetools.py"),
    ("hermes_modal_tool.agent.files.filesums", "agent/files/filesums.py"),
    ("hermes_modal_tool.agent.limits.admission", "agent/limits/admission.py"),
    ("hermes_modal_tool.agent.shells.output", "agent/shells/output.py"),
    ("hermes_modal_tool.agent.shells.shellprocs", "agent/shells/shellprocs.py"),
    ("hermes_modal_tool.agent.state", None),
    ("hermes_modal_tool.agent.state.snapshots", "agent/state/snapshots.py"),
    ("hermes_modal_tool.agent.state.transfer", "agent/state/transfer.py"),
    ("hermes_modal_tool.agent.shells.spawner", "agent/shells/spawner.py"),
    ("hermes_modal_tool.agent.shells.threadstart", "agent/shells/threadstart.py"),
    ("hermes_modal_tool.agent.shells.shellstart", "agent/shells/shellstart.py"),
    ("hermes_modal_tool.agent.shells.shell", "agent/shells/shell.py"),
    ("hermes_modal_tool.agent.slot", "agent/slot.py"),
    ("hermes_modal_tool.agent.limits.caps", "agent/limits/caps.py"),
    ("hermes_modal_tool.agent.limits.gpu", "agent/limits/gpu.py"),
    ("hermes_modal_tool.agent.heartbeat", "agent/heartbeat.py"),
    ("hermes_modal_tool.agent.limits.quiet", "agent/limits/quiet.py"),
    ("hermes_modal_tool.agent.setup", "agent/setup.py"),
    ("hermes_modal_tool.agent.shells.streaming", "agent/shells/streaming.py"),
    ("hermes_modal_tool.agent.shells.ptyhelper", "agent/shells/ptyhelper.py"),
    ("hermes_modal_tool.agent.shells.ptyprocs", "agent/shells/ptyprocs.py"),
    ("hermes_modal_tool.agent.calls", "agent/calls.py"),
    ("hermes_modal_tool.agent.main", "agent/main.py"),
)

BOOTSTRAP = (
    "import os,sys,json,types,marshal\n"
    "sys.modules['ssl']=None\n"
    "def r(n):\n"
    " b=b''\n"
    " while len(b)<n:\n"
    "  c=os.read(0,n-len(b))\n"
    "  if not c: sys.exit(3)\n"
    "  b+=c\n"
    " return b\n"
    "d=r(int(r(10)))\n"
    "for name,src in marshal.loads(d[1:]) if d[:1]==b'M' else json.loads(d.decode()):\n"
    " m=types.ModuleType(name);m.__file__='<hermes-modal-tool:%s>'%name\n"
    " if src is None: m.__path__=[];m.__package__=name\n"
    " else: m.__package__=name.rpartition('.')[0]\n"
    " sys.modules[name]=m\n"
    " p=sys.modules.get(m.__package__)\n"
    " if p is not None and p is not m: setattr(p,name.rpartition('.')[2],m)\n"
    " if isinstance(src,str): exec(compile(src,m.__file__,'exec'),m.__dict__)\n"
    " elif src: exec(src,m.__dict__)\n"
    "sys.modules['hermes_modal_tool.agent.main'].main()\n"
)


@functools.lru_cache(maxsize=2)
def bundle(compiled: bool = False) -> bytes:
    """Return the bytes a driver writes to the agent's stdin before any frame.

    Shape: a 10-digit ASCII length, then that many bytes of payload: the modules as
    ``[[module_name, source_or_null], ...]``, in JSON; or, with ``compiled=True``, ``b"M"``
    and the same list with code objects in place of sources, in :mod:`marshal`'s format,
    which only an interpreter of this exact version can load: the local driver runs the
    agent with ``sys.executable``, so it saves the agent compiling them (~20 ms per start)
    and decoding JSON (~3 ms).
    """
    root = resources.files("hermes_modal_tool")
    mods: list[list] = []
    for name, rel in _MODULES:
        src = None
        if rel is not None:
            src = "# " + rel + "\n" + root.joinpath(rel).read_text(encoding="utf-8")
            if compiled:
                src = compile(src, f"<hermes-modal-tool:{name}>", "exec")
        mods.append([name, src])
    payload = b"M" + marshal.dumps(mods) if compiled else json.dumps(mods).encode("utf-8")
    return b"%010d" % len(payload) + payload


def command(python: str = "python3") -> list[str]:
    """The argv that starts the agent with ``python`` (``-I -S``: no site, no user env)."""
    return [python, "-I", "-S", "-c", BOOTSTRAP]
