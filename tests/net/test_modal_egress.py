"""``network: egress`` on the Modal driver: Modal's outbound allow-lists
(``outbound_cidr_allowlist``, ``outbound_domain_allowlist``), sent by the real ``modal``
SDK to the local control plane, which enforces them outside the container
(testing/modal_server/_network.py) against the fake internet.

The server is given ``network_attach``: each allow-listed sandbox's router namespace is
attached to the fake internet, and nothing else is reachable. Verdicts are read from
inside the container (what connected, how fast a refusal came) with a positive control
from the router's side (the refused address answers there).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import modal
import pytest
from support import SMALL, bash

from hermes_modal_tool import SandboxConfig
from hermes_modal_tool.testing import fakenet as fn
from hermes_modal_tool.testing.modal_server import LocalModalServer, serve_in_thread

#: ``resolve:NAME`` or ``connect:HOST:PORT`` each; prints a JSON list of verdicts.
PROBE = r"""
import json, socket, sys, time
out = []
for arg in sys.argv[1:]:
    kind, _, rest = arg.partition(":")
    t = time.time()
    try:
        if kind == "resolve":
            out.append("ok " + socket.gethostbyname(rest))
        else:
            host, port = rest.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(b"hi")
                out.append("ok " + s.recv(2).decode())
    except OSError as e:
        out.append("%s %.2f" % (type(e).__name__, time.time() - t))
print(json.dumps(out))
"""
CIDRS, DOMAINS = [f"{fn.WWW}/32"], ["api.example.test"]


def refused_fast(verdict: str) -> bool:
    word, seconds = verdict.split()
    return word == "ConnectionRefusedError" and float(seconds) < 0.5


def ns_key(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def held_namespaces() -> set[tuple[int, int]]:
    """What this process's descriptors hold (the server's namespaces among them)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found.add(ns_key(f"/proc/self/fd/{fd}"))
    return found


@pytest.fixture
def egress_server(fakenet: fn.FakeInternet, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalModalServer]:
    """A local control plane whose allow-listed sandboxes reach the fake internet only."""
    def attach(router: str) -> None:
        fakenet.attach(router, default_route=True, standins=True, other_ifaces="hs")

    with serve_in_thread(network_attach=attach, network_dns=fn.DNS) as server:
        assert server.isolation == "bwrap"
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        LocalModalServer.reset_env_client()
        try:
            yield server
        finally:
            LocalModalServer.reset_env_client()


async def test_sdk_allowlist_is_enforced_outside_the_container(egress_server: LocalModalServer) -> None:
    app = await modal.App.lookup.aio("egress-tests", create_if_missing=True)
    sb = await modal.Sandbox.create.aio(app=app, outbound_cidr_allowlist=CIDRS,
                                        outbound_domain_allowlist=DOMAINS)
    try:
        assert egress_server.sandboxes[sb.object_id].allowed == CIDRS + DOMAINS
        net = egress_server._state_of[sb.object_id].net
        inodes = {ns_key(net.router_path), ns_key(f"/proc/self/fd/{net.slots[0].fd}")}
        assert inodes <= held_namespaces()
        # Positive control: from the router (the fake internet's side) OTHER answers.
        with fn.enter_netns(net.router_path):
            fn.connect(fn.OTHER, 7).close()
        p = await sb.exec.aio("python3", "-c", PROBE, "resolve:api.example.test", "resolve:other.test",
                              f"connect:{fn.WWW}:7", f"connect:{fn.API}:7", f"connect:{fn.OTHER}:7")
        out = await p.stdout.read.aio()
        assert await p.wait.aio() == 0, out
        api, other, www, api_conn, refused = json.loads(out)
        assert api == f"ok {fn.API}" and other.startswith("gaierror"), (api, other)
        assert www == "ok hi" and api_conn == "ok hi", (www, api_conn)  # the CIDR; the allowed name's
        assert refused_fast(refused), refused  # outside both lists: a reset, at once
    finally:
        await sb.terminate.aio()
        await sb.wait.aio(raise_on_termination=False)
    assert egress_server._state_of[sb.object_id].net is None
    assert not inodes & held_namespaces()  # the router and the container's namespace: gone


async def test_modal_driver_maps_egress_to_modal_allowlists(
        egress_server: LocalModalServer, make_backend: Any) -> None:
    config = SandboxConfig(name="modal-egress", **{**SMALL, "max_sandboxes": 1}, driver="modal",
                           network="egress", egress={"allow": CIDRS + DOMAINS})
    backend = await make_backend(config=config)
    slot = await backend.acquire("egress-modal")
    [record] = [r for r in egress_server.sandboxes.values() if r.tags.get("hmt-profile") == "modal-egress"]
    assert record.allowed == CIDRS + DOMAINS and not record.block_network
    r = await bash(backend, slot, f"python3 -c '{PROBE}' connect:{fn.WWW}:7 connect:{fn.OTHER}:7")
    assert r.success, r.output
    www, other = json.loads(r.output)
    assert www == "ok hi" and refused_fast(other), (www, other)
    network = backend.get_status()["drivers"]["modal"]["network"]["modal-egress"]
    assert network["modal"] == {"outbound_cidr_allowlist": CIDRS, "outbound_domain_allowlist": DOMAINS}
    assert "outside the container" in network["enforced_by"]
