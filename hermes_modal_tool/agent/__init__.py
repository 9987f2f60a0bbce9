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

import ast
import functools
import json
import marshal
from importlib import resources
from typing import Any


def _imports(tree: ast.Module, name: str, is_pkg: bool) -> set[str]:
    """Every module ``name``'s source imports, at module level or inside functions, as
    absolute names (``from . import x`` names both the package and ``package.x``)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(mod + "." + alias.name for alias in node.names)
    return found


@functools.lru_cache(maxsize=1)
def _bundle_modules() -> tuple[tuple[str, str | None, str | None, ast.Module | None], ...]:
    """The modules sent into the sandbox, derived from the package: ``agent.main`` and
    every module it imports, transitively (under ``hermes_modal_tool/agent/`` and its
    subpackages, and the ``hermes_modal_tool`` modules they import: ``protocol``,
    ``deadlines``; a file nothing imports is not sent), dependencies first (the import
    graph's topological order, imports inside functions counted), each package before
    its modules. Shape: ``((module_name, path_relative_to_the_package, source, tree),
    ...)``, the source headed by a comment naming the file, parsed once (the tree is what
    :func:`bundle` compiles); ``None`` for all three marks a package, installed empty: a package's ``__init__.py`` in the agent
    may hold nothing but a docstring (this one is the host's, never sent).

    Raises ``ValueError`` naming the module on an import cycle, an agent package
    ``__init__.py`` with code, or an import of a ``hermes_modal_tool`` module that does
    not exist (a file moved without its importers)."""
    root = resources.files("hermes_modal_tool")
    files: dict[str, str] = {}  # module name -> path relative to the package
    parsed: dict[str, tuple[str, ast.Module]] = {}
    pending = [("hermes_modal_tool.agent", "agent")]
    while pending:
        pkg, rel = pending.pop()
        for entry in root.joinpath(rel).iterdir():
            if entry.is_dir() and entry.joinpath("__init__.py").is_file():
                pending.append((pkg + "." + entry.name, rel + "/" + entry.name))
            elif entry.name.endswith(".py"):
                stem = entry.name[:-3]
                files[pkg if stem == "__init__" else pkg + "." + stem] = rel + "/" + entry.name
    deps: dict[str, set[str]] = {}
    # What ``main`` imports, and what they import (inside functions too): a file under
    # agent/ that nothing imports (a stale one an old install left, or a module not yet
    # wired) is not sent, and cannot break the agent's start.
    todo = ["hermes_modal_tool.agent.main"]
    while todo:
        name = todo.pop()
        if name in deps:
            continue
        rel = files.get(name) or name.split(".", 1)[1].replace(".", "/") + ".py"
        if name not in files and not root.joinpath(rel).is_file():
            raise ValueError(f"agent bundle: {name} is imported but is no module of the package")
        text = "# " + rel + "\n" + root.joinpath(rel).read_text(encoding="utf-8")
        tree = ast.parse(text, f"<hermes-modal-tool:{name}>")
        parsed[name] = (text, tree)
        is_pkg = rel.endswith("__init__.py")
        if is_pkg and any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
                          for n in tree.body):
            raise ValueError(f"agent bundle: {rel} holds code; it is installed empty")
        found = _imports(tree, name, is_pkg)
        mine = set()
        for mod in found:
            if mod.partition(".")[0] != "hermes_modal_tool" or mod in (name, "hermes_modal_tool"):
                continue
            if mod in files or root.joinpath(mod.split(".", 1)[1].replace(".", "/") + ".py").is_file():
                mine.add(mod)
            elif mod.rpartition(".")[0] not in found:  # not ``from package import name``
                raise ValueError(f"agent bundle: {rel} imports {mod}, which does not exist")
        files.setdefault(name, rel)
        parent = name.rpartition(".")[0]
        deps[name] = {m for m in mine if m != "hermes_modal_tool"} | ({parent} if parent else set())
        todo.extend(deps[name] - {"hermes_modal_tool.agent", "hermes_modal_tool"})
    for name in ("hermes_modal_tool", "hermes_modal_tool.agent"):
        deps[name] = {name.rpartition(".")[0]} - {""}
    order: list[tuple[str, str | None, str | None, ast.Module | None]] = []
    done: set[str] = set()
    while len(done) < len(deps):
        ready = sorted(n for n in deps if n not in done and deps[n] <= done)
        if not ready:
            stuck = sorted(n for n in deps if n not in done)
            raise ValueError(f"agent bundle: import cycle among {stuck}")
        for name in ready:
            if name in parsed and not files[name].endswith("__init__.py"):
                text, tree = parsed[name]
                order.append((name, files[name], text, tree))
            else:  # a package: installed empty
                order.append((name, None, None, None))
            done.add(name)
    return tuple(order)


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
    mods: list[list[Any]] = []
    for name, _rel, text, tree in _bundle_modules():
        src: Any = text
        if compiled and tree is not None:
            src = compile(tree, f"<hermes-modal-tool:{name}>", "exec")
        mods.append([name, src])
    payload = b"M" + marshal.dumps(mods) if compiled else json.dumps(mods).encode("utf-8")
    return b"%010d" % len(payload) + payload


def command(python: str = "python3") -> list[str]:
    """The argv that starts the agent with ``python`` (``-I -S``: no site, no user env)."""
    return [python, "-I", "-S", "-c", BOOTSTRAP]
