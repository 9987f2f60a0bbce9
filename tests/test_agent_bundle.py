"""The agent's bundle (``agent.bundle``) is derived from the package and starts on its own.

A driver sends the bundle into a sandbox that has none of our code installed; the bundle's
module list and order come from the package's import graph (``agent._bundle_modules``), not
from a hand-kept list. Here an agent is started from the bundle alone: ``python3 -I -S``
(no site-packages, so no installed copy of this package; no environment paths) in an empty
temporary directory, fed the bundle and protocol frames, and must answer ``init`` and run a
``bash`` call in a slot. Run with the source bundle on the oldest Python the agent supports
(3.8, where pyenv has one) and with the compiled bundle on this interpreter, as the Modal
and local drivers do.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from hermes_modal_tool import agent, protocol

PY38 = Path(os.path.expanduser("~/.pyenv/versions/3.8.18/bin/python3.8"))


def _frame(msg: dict) -> bytes:
    data = json.dumps(msg).encode()
    return struct.pack(">I", len(data)) + data


def _read(out, want_id: int) -> dict:
    while True:
        head = out.read(4)
        assert len(head) == 4, "the agent closed its stdout before answering"
        msg = json.loads(out.read(struct.unpack(">I", head)[0]))
        if msg.get("id") == want_id:
            return msg


def _run_bundle(python: str, compiled: bool, tmp_path: Path) -> tuple[dict, dict]:
    state = tmp_path / "state"
    work = tmp_path / "work"
    state.mkdir()
    work.mkdir()
    cwd = tmp_path / "empty"
    cwd.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no PYTHONPATH; -I ignores it anyway
    proc = subprocess.Popen(agent.command(python), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=cwd, env=env)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(agent.bundle(compiled=compiled))
        config = {"workspace_base": str(work), "state_dir": str(state), "slots": 1,
                  "isolation": "none", "cgroups": False, "filesystem": "workspace-only"}
        proc.stdin.write(_frame({"id": 1, "op": "init", "config": config}))
        proc.stdin.write(_frame({"id": 2, "op": "call", "slot": 0, "tool": "bash",
                                 "args": {"command": "echo from-$((6*7)); python3 -c pass; exit 3"},
                                 "timeout": 60}))
        proc.stdin.flush()
        init = _read(proc.stdout, 1)
        call = _read(proc.stdout, 2)
        proc.stdin.write(_frame({"id": 3, "op": "shutdown"}))
        proc.stdin.flush()
        _read(proc.stdout, 3)
        return init, call
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        if err:
            print(err.decode(errors="replace")[-3000:])


def test_bundle_order_is_derived_from_the_package() -> None:
    """Every agent module on disk that ``main`` reaches is in the bundle (subpackages too;
    all but agent/net/, not wired yet: see the next test), with the modules the agent
    imports from outside it, each package before its modules (the import order itself is
    proven by the start below)."""
    mods = agent._bundle_modules()
    names = [m[0] for m in mods]
    root = Path(agent.__file__).parent
    on_disk = {"hermes_modal_tool.agent." + ".".join(p.relative_to(root).with_suffix("").parts)
               .removesuffix(".__init__") for p in root.rglob("*.py") if p.name != "__init__.py" or p.parent != root}
    wired = {n for n in on_disk if not n.startswith("hermes_modal_tool.agent.net")}
    assert len(wired) > 40 and wired <= set(names), sorted(wired - set(names))
    assert {"hermes_modal_tool.protocol", "hermes_modal_tool.deadlines"} <= set(names)
    for i, name in enumerate(names):
        parent = name.rpartition(".")[0]
        assert not parent or names.index(parent) < i, (name, parent)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "source"])
def test_agent_starts_from_the_bundle_alone(tmp_path: Path, compiled: bool) -> None:
    python = sys.executable if compiled else str(PY38 if PY38.exists() else sys.executable)
    # Positive control: the interpreter really cannot import the package on its own.
    probe = subprocess.run([python, "-I", "-S", "-c", "import hermes_modal_tool"], cwd=tmp_path,
                           capture_output=True, env={"PATH": "/usr/bin:/bin"})
    assert probe.returncode != 0 and b"ModuleNotFoundError" in probe.stderr
    init, call = _run_bundle(python, compiled, tmp_path)
    assert init["ok"], init
    assert init["result"]["python"].startswith("3.8" if python != sys.executable else "3."), init
    assert call["ok"], call
    result = call["result"]
    assert "from-42" in result["output"], result
    assert result["returncode"] == 3, result
    assert set(protocol.RESULT_KEYS) <= set(result)


def test_only_what_main_imports_is_sent():
    """The bundle is what ``agent.main`` imports, transitively (inside functions too), not
    every file under agent/: a stale module an old install left there (a wheel built over a
    ``build/`` of the flat layout once shipped ``agent/snapshots.py`` beside
    ``agent/state/snapshots.py``, and the import cycle between the stale files stopped
    every sandbox start), is not sent. ``agent/net/`` is sent since setup imports it
    (``network: egress``); the host-side modules beside the agent's are not."""
    from hermes_modal_tool import agent

    sent = {name for name, *_ in agent._bundle_modules()}
    assert {"hermes_modal_tool.agent.main", "hermes_modal_tool.agent.calls",
            "hermes_modal_tool.agent.state.ops", "hermes_modal_tool.protocol",
            "hermes_modal_tool.agent.net.slotnet", "hermes_modal_tool.agent.net.resolver"} <= sent
    on_disk = {p.stem for p in (Path(agent.__file__).parent.parent / "testing").glob("*.py")}
    assert "fakenet" in on_disk  # positive control: host-side modules exist beside it
    assert not any(name.startswith("hermes_modal_tool.testing") for name in sent), sorted(sent)
