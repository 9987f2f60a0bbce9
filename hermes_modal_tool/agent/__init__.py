"""The in-sandbox agent and how a driver starts it.

A driver runs ``python3 -I -S -c BOOTSTRAP`` in the sandbox (locally, or through
one long-lived Modal ``exec``) and writes :func:`bundle` to its stdin, followed by
protocol frames. The bootstrap reads the bundle (the agent's stdlib-only modules),
installs them under their package names and starts the agent, so no image needs
our code installed: any image with ``python3`` >= 3.8 works. The bootstrap blocks
``ssl`` (``asyncio`` imports it when present): the agent speaks no TLS, and loading
OpenSSL is a few milliseconds of every start.
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
    ("hermes_modal_tool.agent.scopes", "agent/scopes.py"),
    ("hermes_modal_tool.agent.sysvipc", "agent/sysvipc.py"),
    ("hermes_modal_tool.agent.isolation", "agent/isolation.py"),
    ("hermes_modal_tool.agent.volumes", "agent/volumes.py"),
    ("hermes_modal_tool.agent.mounts", "agent/mounts.py"),
    ("hermes_modal_tool.agent.cgroupv2", "agent/cgroupv2.py"),
    ("hermes_modal_tool.agent.cgroups", "agent/cgroups.py"),
    ("hermes_modal_tool.agent.procs", "agent/procs.py"),
    ("hermes_modal_tool.agent.owned", "agent/owned.py"),
    ("hermes_modal_tool.agent.rootplan", "agent/rootplan.py"),
    ("hermes_modal_tool.agent.trees", "agent/trees.py"),
    ("hermes_modal_tool.agent.beneath", "agent/beneath.py"),
    ("hermes_modal_tool.agent.usage", "agent/usage.py"),
    ("hermes_modal_tool.agent.layerspares", "agent/layerspares.py"),
    ("hermes_modal_tool.agent.slotdisk", "agent/slotdisk.py"),
    ("hermes_modal_tool.agent.rootfs", "agent/rootfs.py"),
    ("hermes_modal_tool.agent.rootprobe", "agent/rootprobe.py"),
    ("hermes_modal_tool.agent.slottmpfs", "agent/slottmpfs.py"),
    ("hermes_modal_tool.agent.diskwatch", "agent/diskwatch.py"),
    ("hermes_modal_tool.agent.shmwatch", "agent/shmwatch.py"),
    ("hermes_modal_tool.agent.files", "agent/files.py"),
    ("hermes_modal_tool.agent.wipes", "agent/wipes.py"),
    ("hermes_modal_tool.agent.filetools", "agent/filetools.py"),
    ("hermes_modal_tool.agent.filesums", "agent/filesums.py"),
    ("hermes_modal_tool.agent.admission", "agent/admission.py"),
    ("hermes_modal_tool.agent.output", "agent/output.py"),
    ("hermes_modal_tool.agent.shellprocs", "agent/shellprocs.py"),
    ("hermes_modal_tool.agent.snapshots", "agent/snapshots.py"),
    ("hermes_modal_tool.agent.transfer", "agent/transfer.py"),
    ("hermes_modal_tool.agent.spawner", "agent/spawner.py"),
    ("hermes_modal_tool.agent.threadstart", "agent/threadstart.py"),
    ("hermes_modal_tool.agent.shellstart", "agent/shellstart.py"),
    ("hermes_modal_tool.agent.shell", "agent/shell.py"),
    ("hermes_modal_tool.agent.slot", "agent/slot.py"),
    ("hermes_modal_tool.agent.caps", "agent/caps.py"),
    ("hermes_modal_tool.agent.gpu", "agent/gpu.py"),
    ("hermes_modal_tool.agent.heartbeat", "agent/heartbeat.py"),
    ("hermes_modal_tool.agent.quiet", "agent/quiet.py"),
    ("hermes_modal_tool.agent.setup", "agent/setup.py"),
    ("hermes_modal_tool.agent.streaming", "agent/streaming.py"),
    ("hermes_modal_tool.agent.ptyhelper", "agent/ptyhelper.py"),
    ("hermes_modal_tool.agent.ptyprocs", "agent/ptyprocs.py"),
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
