"""The package's import graph: no cycles, and no import against the layer order.

Walks every module of ``hermes_modal_tool`` (and ``adapters/``, installed as
``hermes_modal_tool.adapters``) with :mod:`ast` and builds the graph of imports between
them: at module level, inside functions, and inside ``if TYPE_CHECKING:`` blocks (those
reported apart: they cost nothing at run time, but still show a class split into files
that each know the whole). Fails on a cycle, and on an import of a layer above the
importer's (the layers as in ARCHITECTURE.md; same layer is fine). ``python
tests/test_import_graph.py`` prints the graph's cycles and upward imports.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"hermes_modal_tool": REPO / "hermes_modal_tool", "hermes_modal_tool.adapters": REPO / "adapters"}
P = "hermes_modal_tool."
#: The layers, top to bottom; a module may import its own layer and the ones below.
LAYERS = [
    ("front", ["hermes_modal_tool", P + "__main__", P + "adapters", P + "cli", P + "mcp_server", P + "_mcp_auth",
               P + "_mcp_previews",
               P + "testing"]),
    ("sessions/backend", [P + m for m in (
        "sessions", "capture", "backend", "_artifact_api", "_snapshot_api", "_status_api", "_call_api",
        "filetransfer", "_transfer_wire", "_transfer_probe", "previews", "_transfer_tree", "_transfer_resume", "processes", "shared_setup", "snapshots", "sandbox_images", "transfer",
        "streaming", "status", "_backend_view", "hostprocs")]),
    ("pool", [P + m for m in ("pool", "_pool_status", "_pool_usage", "_pool_pick", "_pool_calls", "resets",
                              "_slot_record")]),
    ("sandbox", [P + "sandbox", P + "_call_group"]),
    ("drivers", [P + "drivers", P + "images"]),
    ("config and shared types", [P + m for m in (
        "config", "profiles", "volumes", "gpus", "secrets", "slots", "usage", "tools", "portal", "loops",
        "tracing", "_version", "modal_network", "network_config")]),
    ("agent", [P + "agent"]),
    ("protocol/errors", [P + m for m in ("protocol", "toolargs", "deadlines", "errors")]),
]
#: The agent's rooms, top to bottom (agent/__init__.py); a room not listed (a new
#: subpackage) sits just below the top: main and the router may use it, no room below.
AGENT = P + "agent"
#: Cycles that exist only through ``if TYPE_CHECKING:`` imports and are known: none may be
#: added. ``profiles`` annotates with ``SandboxConfig``, the class it builds (at run time it
#: is handed the class: ``config`` imports ``profiles``, never the reverse).
KNOWN_TYPE_ONLY = [[P + "config", P + "profiles"]]
ROOMS = ["<top>", "<new room>", "state", "shells", "limits", "files", "fs"]


def modules() -> dict[str, Path]:
    found = {}
    for pkg, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join((pkg, *parts)).removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path],
            missing: list[str] | None = None) -> list[tuple[str, str, int]]:
    """``(imported module, kind, line)``; kind is "module", "function" or "type"."""
    out: list[tuple[str, str, int]] = []
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

    def walk(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            k = kind
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for c in child.body:
                    walk(ast.Module(body=[c], type_ignores=[]), "type")
                for c in child.orelse:
                    walk(ast.Module(body=[c], type_ignores=[]), kind)
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and kind == "module":
                k = "function"
            if isinstance(child, ast.Import):
                out.extend((a.name, k, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                mod = ".".join(base[: len(base) - child.level + 1] + [child.module or ""]).strip(".") \
                    if child.level else child.module or ""
                for a in child.names:
                    sub = mod + "." + a.name
                    out.append((sub if sub in known else mod, k, child.lineno))
            walk(child, k)

    walk(ast.parse(path.read_text(encoding="utf-8")), "module")
    if missing is not None:  # imports of the package that name no module of it
        missing.extend(f"{name}:{line} imports {m}, which is no module" for m, k, line in out
                       if m.partition(".")[0] == "hermes_modal_tool" and m not in known)
    return [(m, k, line) for m, k, line in out if m in known and m != name]


def graph() -> dict[str, list[tuple[str, str, int]]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(g: dict[str, list[tuple[str, str, int]]], kinds: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), as sorted names."""
    adj = {n: sorted({m for m, k, _ in es if k in kinds}) for n, es in g.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                comp.append(stack.pop())
                if comp[-1] == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(adj):
        if v not in index:
            visit(v)
    return found


def _rank(name: str, layers: list[tuple[str, list[str]]]) -> int:
    best = max(((len(p), i) for i, (_, ps) in enumerate(layers) for p in ps
                if name == p or (p != "hermes_modal_tool" and name.startswith(p + "."))), default=None)
    if best is None:
        raise AssertionError(f"{name} is in no layer: add it to LAYERS in {__file__}")
    return best[1]


def _room(name: str) -> int:
    parts = name[len(AGENT) + 1:].split(".")
    if len(parts) == 1 or parts[0] == "":  # agent/__init__, main, calls, setup, slot, ...
        return 0
    return ROOMS.index(parts[0]) if parts[0] in ROOMS else 1


def upward(g: dict[str, list[tuple[str, str, int]]]) -> list[str]:
    bad = []
    for name, es in sorted(g.items()):
        for mod, kind, line in es:
            a, b = _rank(name, LAYERS), _rank(mod, LAYERS)
            inside = name.startswith(AGENT) and mod.startswith(AGENT + ".")
            if b < a or (inside and _room(mod) < _room(name)):
                bad.append(f"{name}:{line} imports {mod} ({kind}), a layer above it")
    return bad


def _describe(g: dict[str, list[tuple[str, str, int]]], comp: list[str], kinds: set[str]) -> str:
    edges = sorted({f"    {n}:{line} -> {m} ({k})" for n in comp for m, k, line in g[n] if m in comp and k in kinds})
    return "cycle among " + ", ".join(comp) + "\n" + "\n".join(edges)


def test_no_import_cycles_at_run_time() -> None:
    g = graph()
    found = cycles(g, {"module", "function"})
    assert not found, "\n".join(_describe(g, c, {"module", "function"}) for c in found)


def test_no_import_cycles_counting_type_checking_imports() -> None:
    """Reported apart: a cycle through ``TYPE_CHECKING`` imports costs nothing at run time,
    but shows a class split into files that each know the whole."""
    g = graph()
    found = [c for c in cycles(g, {"module", "function", "type"}) if c not in KNOWN_TYPE_ONLY]
    assert not found, "\n".join(_describe(g, c, {"module", "function", "type"}) for c in found)


def test_no_import_against_the_layer_order() -> None:
    bad = upward(graph())
    assert not bad, "\n".join(bad)


def test_the_walk_sees_every_kind_of_import() -> None:
    """Positive control: the graph holds known edges of each kind (module level, inside a
    function, TYPE_CHECKING), so an empty result above is not a walk that saw nothing."""
    g = graph()
    kinds = {k for es in g.values() for _, k, _ in es}
    assert kinds == {"module", "function", "type"}, kinds
    assert (P + "sandbox", "module") in {(m, k) for m, k, _ in g[P + "pool"]}
    assert len(g) > 100



def test_every_import_of_the_package_names_a_module():
    """An import of a moved or removed module fails here, before it fails at run time
    inside a function (``from ..agent.trees import ...`` in the Ray actor, after the
    agent's move, only failed when a Ray sandbox started)."""
    known = modules()
    missing: list[str] = []
    for name, path in known.items():
        imports(name, path, known, missing)
    assert not missing, "\n".join(missing)

if __name__ == "__main__":
    g = graph()
    for label, kinds in (("run time", {"module", "function"}), ("with TYPE_CHECKING", {"module", "function", "type"})):
        found = cycles(g, kinds)
        print(f"{label}: {len(found)} cycles")
        for comp in found:
            print("  " + _describe(g, comp, kinds).replace("\n", "\n  "))
    bad = upward(g)
    print(f"upward imports: {len(bad)}")
    print("\n".join("  " + b for b in bad))
