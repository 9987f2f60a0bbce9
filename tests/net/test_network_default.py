"""``network: egress`` is the default: a profile that says nothing about the network
gives its slots a namespace of their own with no reach into the host, ``true`` is an
alias of ``egress`` (with one note), and where the agent cannot make namespaces the
default becomes ``none`` (never the host's network) and says so, while an explicit
``egress`` fails the start.

Verdicts from the slot's side (what it connected to, and how fast a refusal came)
with positive controls beside them: the same listener answers the host itself and a
``network: host`` slot. The non-root case runs the agent's own start-up code as
``nobody`` (``setpriv``), so the kernel itself refuses the namespace.
"""

from __future__ import annotations

import os
import shutil
import socket
import socketserver
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
from support import SMALL, bash

from hermes_modal_tool import ConfigWarning, SandboxConfig
from hermes_modal_tool import network_config as nc

from .test_slot_network import host_address, probe

REPO = Path(__file__).resolve().parents[2]


def test_an_unset_network_is_egress_and_true_is_its_alias_with_one_note(monkeypatch: Any) -> None:
    assert SandboxConfig(name="p").network == "egress"
    assert SandboxConfig(name="p", isolation="none").network == "host"  # no namespaces at all
    assert SandboxConfig(name="p", network=False).network == "none"
    monkeypatch.setattr(nc, "_TRUE_NOTED", [])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = SandboxConfig(name="p", network=True)
        second = SandboxConfig.from_dict("q", {"network": "yes"})
    assert (first.network, second.network) == ("egress", "egress")
    notes = [w for w in seen if issubclass(w.category, ConfigWarning)]
    assert len(notes) == 1 and "network: host" in str(notes[0].message), [str(w.message) for w in seen]
    with pytest.raises(ValueError, match="isolation: bwrap"):
        SandboxConfig(name="p", isolation="none", network="egress")


class EchoTwo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.sendall(self.request.recv(2))


class EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


async def test_a_default_slot_cannot_reach_the_hosts_services(make_backend: Any) -> None:
    """The profile says nothing about the network: the slot reaches neither a service on
    the host's loopback nor one on the host's own address, and fails fast; a
    ``network: host`` slot reaches both (the positive control)."""
    host = host_address()
    listener = EchoServer(("0.0.0.0", 0), EchoTwo)
    threading.Thread(target=listener.serve_forever, daemon=True).start()
    port = listener.server_address[1]
    try:
        with socket.create_connection(("127.0.0.1", port), 3), socket.create_connection((host, port), 3):
            pass  # the host itself reaches it on both addresses
        backend = await make_backend(config=SandboxConfig(name="dflt", **SMALL))
        opened = await make_backend(config=SandboxConfig(name="hostnet", **SMALL, network="host"))
        slot, control = await backend.acquire("d"), await opened.acquire("h")
        status = backend.get_status()
        pool = status["pools"]["dflt"] if "pools" in status else status
        assert pool["network"] == "egress" and pool["network_note"] is None, pool
        verdicts = await probe(backend, slot, f"connect:127.0.0.1:{port}", f"connect:{host}:{port}",
                               "connect:169.254.169.254:80")
        reached = await probe(opened, control, f"connect:127.0.0.1:{port}", f"connect:{host}:{port}")
    finally:
        listener.shutdown()
        listener.server_close()
    assert reached == ["ok hi", "ok hi"], reached
    for v in verdicts:
        word, seconds = v.split()
        assert word == "ConnectionRefusedError" and float(seconds) < 1, verdicts
    r = await bash(backend, slot, "ip -o -4 addr show eth0")
    assert r.success and "10.254." in r.output, r.output  # its own namespace, behind the router


def python_for_nobody() -> str:
    """An interpreter ``nobody`` may run (the agent's code is stdlib-only, 3.8+)."""
    for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if not candidate:
            continue
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            candidate, "-c", "pass"], capture_output=True, timeout=30)
        if r.returncode == 0:
            return candidate
    raise AssertionError("no Python that nobody can run: cannot show the non-root start")


#: Run as nobody: the agent's start-up of network: egress, implicit then explicit.
AS_NOBODY = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from hermes_modal_tool.agent.net import slotnet
out = {}
net, note = slotnet.start_or_degrade({"dns": "192.0.2.1"}, "the profile's egress", False)
out["implicit"] = [net is None, note]
try:
    slotnet.start_or_degrade({"dns": "192.0.2.1"}, "the profile's egress", True)
    out["explicit"] = "started"
except slotnet.NetError as exc:
    out["explicit"] = str(exc)
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to become nobody")
def test_an_agent_that_is_not_root_degrades_the_default_and_refuses_explicit_egress(tmp_path: Path) -> None:
    import json

    copy = tmp_path / "src"  # readable by nobody wherever the checkout is
    shutil.copytree(REPO / "hermes_modal_tool" / "agent", copy / "hermes_modal_tool" / "agent")
    (copy / "hermes_modal_tool" / "__init__.py").write_text("")
    for d, _dirs, files in os.walk(tmp_path):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        python_for_nobody(), "-c", AS_NOBODY, str(copy)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    degraded, note = out["implicit"]
    assert degraded and "not root" in note and "network: host" in note, out
    assert "could not start" in out["explicit"] and "not root" in out["explicit"], out
    assert "network: none" in out["explicit"], out
