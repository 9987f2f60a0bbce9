"""A slot's egress enforced from the agent's namespace (agent/net/nftrules.py): a slot
namespace behind a veth pair, its policy as nftables rules and its resolver in the
agent's namespace, against the fake internet. Not yet the spawner's slots (the lead
wires agent/net in next); the namespace layout is the one it will use."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from dnslib import RCODE, DNSRecord

from hermes_modal_tool.agent.net import nftrules
from hermes_modal_tool.agent.net.policy import EgressPolicy
from hermes_modal_tool.agent.net.resolver import DnsResolver
from hermes_modal_tool.testing import fakenet as fn

AGENT_END, SLOT_END, IFACE = "10.201.0.1", "10.201.0.2", "hmts1"


def nft(agent: fn.NetNs, script: str) -> None:
    r = agent.run("nft", "-f", "-", input=script)
    assert r.returncode == 0, r.stderr


@pytest.fixture
def slot_egress(fakenet: fn.FakeInternet, request: pytest.FixtureRequest,
                ) -> Iterator[tuple[fn.NetNs, fn.NetNs, EgressPolicy, DnsResolver]]:
    """A slot namespace behind a veth pair into an agent namespace on the fake internet,
    its rules and resolver there; its allow list is ``["*.example.test"]`` unless the
    test passes another (``indirect`` parametrization)."""
    agent = fakenet.netns(default_route=True)  # the agent's (the host's) namespace
    slot = fn.NetNs(userns=True)  # owned by a user namespace of its own, as a slot's is
    r = agent.run("ip", "-batch", "-", input=(
        f"link add name {IFACE} type veth peer name eth0 netns {slot.pid}\n"
        f"addr add {AGENT_END}/30 dev {IFACE}\nlink set {IFACE} up\n"))
    assert r.returncode == 0, r.stderr
    r = slot.run("ip", "-batch", "-", input=(
        f"addr add {SLOT_END}/30 dev eth0\nlink set eth0 up\nroute add default via {AGENT_END}\n"))
    assert r.returncode == 0, r.stderr
    fn.wait_carrier(slot.path, "eth0")
    assert agent.run("sysctl", "-q", "-w", "net.ipv4.ip_forward=1").returncode == 0
    allow = getattr(request, "param", ["*.example.test"])
    policy = EgressPolicy(allow=allow, host_addresses=[agent.address or ""])

    def learned(name: str, addresses: list, ttl: int) -> None:
        nft(agent, nftrules.learn_command(1, addresses, ttl))

    with agent.enter():
        resolver = DnsResolver(policy, upstream=(fn.DNS, 53), bind=(AGENT_END, 53), on_learn=learned).start()
    nft(agent, nftrules.slot_ruleset(1, IFACE, SLOT_END, policy, resolver.address))
    try:
        yield agent, slot, policy, resolver
    finally:
        resolver.close()
        slot.close()  # the veth pair goes with the slot's namespace


def refused(address: str, port: int) -> float:
    """Seconds a connect to ``(address, port)`` took to be refused (fails the test if
    it connected or failed otherwise)."""
    t = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((address, port), timeout=5).close()
    return time.monotonic() - t


def test_slot_reaches_allowed_names_only(slot_egress: tuple) -> None:
    agent, slot, policy, resolver = slot_egress
    # Positive controls from the agent's namespace: each destination answers there.
    with agent.enter():
        for address in (fn.WWW, fn.OTHER, fn.PRIVATE, fn.METADATA):
            fn.connect(address, 7).close()
        listener = socket.create_server(("0.0.0.0", 0))  # a service on the agent's own addresses
        port = listener.getsockname()[1]
    try:
        with slot.enter():
            # Before its name resolved, www's address is refused, at once.
            assert refused(fn.WWW, 7) < 0.5
            answer = DNSRecord.parse(DNSRecord.question("www.example.test").send(AGENT_END, 53, timeout=5))
            assert [str(rr.rdata) for rr in answer.rr] == [fn.WWW]
            with fn.connect(fn.WWW, 7) as s:
                s.sendall(b"hi")
                assert s.recv(2) == b"hi"
            # DNS to another server is the slot's resolver all the same: the fake DNS
            # would answer other.test; the policy says NXDOMAIN.
            direct = DNSRecord.parse(DNSRecord.question("other.test").send(fn.DNS, 53, timeout=5))
            assert direct.header.rcode == RCODE.NXDOMAIN and resolver.refused == 1
            for address, port_ in ((fn.OTHER, 7), (fn.PRIVATE, 7), (fn.METADATA, 7),
                                   (agent.address, port), (AGENT_END, port)):
                assert refused(address, port_) < 0.5, address
    finally:
        listener.close()
    listing = agent.run("nft", "-j", "list", "table", "inet", nftrules.table_name(1)).stdout
    assert nftrules.refusal_count(listing) >= 6
    assert policy.learned() == {fn.WWW: "www.example.test"}


def test_slot_root_cannot_lift_the_policy(slot_egress: tuple) -> None:
    """Root of the slot's own user namespace (every capability over the slot's network
    namespace) flushes its rules and rewrites its routes, and tries the agent's
    namespace: the agent's table is unchanged and still refuses."""
    agent, slot, _, _ = slot_egress
    before = agent.run("nft", "-s", "list", "table", "inet", nftrules.table_name(1)).stdout
    assert "learned4" in before
    own = slot.run_as_owner("sh", "-c", "nft flush ruleset && ip route replace default via "
                            f"{AGENT_END} && ip link set lo mtu 1500 && echo own-namespace-ok")
    assert own.stdout.strip() == "own-namespace-ok", own.stderr  # the positive control
    for cmd in (["nsenter", f"--net={agent.path}", "nft", "flush", "ruleset"],
                ["nsenter", f"--net={agent.path}", "ip", "link", "del", IFACE]):
        r = slot.run_as_owner(*cmd)
        assert r.returncode != 0 and ("Permission denied" in r.stderr or "not permitted" in r.stderr), r
    with slot.enter():
        assert refused(fn.OTHER, 7) < 0.5
    after = agent.run("nft", "-s", "list", "table", "inet", nftrules.table_name(1)).stdout
    assert after == before


def test_release_removes_the_table(fakenet: fn.FakeInternet) -> None:
    agent = fakenet.netns()
    nft(agent, nftrules.slot_ruleset(7, "hmts7", SLOT_END, EgressPolicy(), (AGENT_END, 53)))
    assert nftrules.table_name(7) in agent.run("nft", "list", "tables").stdout
    nft(agent, nftrules.delete_table(7))
    assert nftrules.table_name(7) not in agent.run("nft", "list", "tables").stdout


@pytest.mark.parametrize("slot_egress", [[]], indirect=True)
def test_open_egress_still_refuses_private_and_host(slot_egress: tuple) -> None:
    """With no allow list (open egress) a raw public address connects, and the
    defaults still refuse the private and metadata stand-ins and the agent's address."""
    agent, slot, policy, _ = slot_egress
    assert policy.open
    with agent.enter():
        for address in (fn.PRIVATE, fn.METADATA):
            fn.connect(address, 7).close()
    with slot.enter():
        fn.connect(fn.OTHER, 7).close()
        for address in (fn.PRIVATE, fn.METADATA, agent.address):
            assert refused(address, 7) < 0.5, address
