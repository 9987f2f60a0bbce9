"""The agent's egress policy and resolver (hermes_modal_tool/agent/net), against the
fake internet: the upstream DNS and every destination here really answer, so each
refusal below is the policy's, not an absent server's."""

from __future__ import annotations

import ipaddress
import struct

import pytest
from dnslib import QTYPE, RCODE, RR, DNSRecord

from hermes_modal_tool.agent.net import dnswire
from hermes_modal_tool.agent.net.hostaddrs import host_addresses
from hermes_modal_tool.agent.net.policy import EgressPolicy, PolicyError
from hermes_modal_tool.agent.net.resolver import DnsResolver
from hermes_modal_tool.testing import fakenet as fn


def _ask(resolver: DnsResolver, name: str, tcp: bool = False, qtype: str = "A") -> DNSRecord:
    host, port = resolver.address
    return DNSRecord.parse(DNSRecord.question(name, qtype).send(host, port, tcp=tcp, timeout=5))


def test_resolver_answers_allowed_names_only(fakenet: fn.FakeInternet) -> None:
    """Allowed names resolve through the fake internet's DNS and their addresses become
    connectable; a denied name (deny beats the wildcard) and a name outside the allow
    list get NXDOMAIN without going upstream, and are counted."""
    ns = fakenet.netns()
    policy = EgressPolicy(allow=["*.example.test"], deny=["api.example.test"], where="test")
    with ns.enter():
        resolver = DnsResolver(policy, upstream=(fn.DNS, 53)).start()
    try:
        with ns.enter():
            assert policy.check(fn.WWW, 443, count=False).allowed is False  # not yet resolved
            www = _ask(resolver, "WWW.example.test.")
            assert [str(r.rdata) for r in www.rr] == [fn.WWW] and www.rr[0].ttl == 60
            pypi = _ask(resolver, "pypi.example.test", tcp=True)
            assert [str(r.rdata) for r in pypi.rr] == [fn.PYPI]
            # The upstream's own NXDOMAIN, relayed: an allowed name it does not know.
            assert _ask(resolver, "nosuch.example.test").header.rcode == RCODE.NXDOMAIN
            assert resolver.forwarded == 3
            for name, tcp in (("api.example.test", False), ("other.test", True), ("example.test", False)):
                reply = _ask(resolver, name, tcp=tcp)
                assert reply.header.rcode == RCODE.NXDOMAIN and not reply.rr, name
            assert resolver.forwarded == 3 and resolver.refused == 3
            # An allowed name that resolves to a private address (rebinding): the
            # answer is relayed, the address stays refused.
            rebind = _ask(resolver, "rebind.example.test")
            assert [str(r.rdata) for r in rebind.rr] == [fn.PRIVATE]
    finally:
        resolver.close()
    assert policy.learned() == {fn.WWW: "www.example.test", fn.PYPI: "pypi.example.test",
                                fn.PRIVATE: "rebind.example.test"}
    assert policy.check(fn.WWW, 443).allowed and policy.check(fn.PYPI, 443).allowed
    assert policy.check(fn.API, 80).allowed is False  # its name was denied: never learned
    assert policy.check(fn.PRIVATE, 80).reason == "in 10.0.0.0/8, denied by default"
    counts = policy.refusals()
    assert counts["total"] == 5
    assert counts["by_destination"] == {"api.example.test": 1, "other.test": 1, "example.test": 1,
                                        f"{fn.API}:80": 1, f"{fn.PRIVATE}:80": 1}
    assert policy.refusals(reset=True)["total"] == 5 and policy.refusals()["total"] == 0


def test_default_denials_of_destinations_that_answer(fakenet: fn.FakeInternet) -> None:
    """Each address the defaults refuse answers a plain connection here (the positive
    control), and the policy refuses it: a raw IP outside the allow list, a private
    address, the metadata endpoint, 127.0.0.1, this namespace's own address, and the
    IPv4-mapped IPv6 form of loopback; an allow CIDR reopens a private range."""
    ns = fakenet.netns()
    policy = EgressPolicy(allow=["198.51.100.0/25", "*.example.test"], host_addresses=[ns.address or ""])
    with ns.enter():
        own = host_addresses()
        assert ns.address in own and "127.0.0.1" in own
        for address in (fn.WWW, fn.OTHER, fn.PRIVATE, fn.METADATA):
            fn.connect(address, 7).close()
        assert policy.check(fn.WWW, 7).allowed  # the allow CIDR
        refused = {fn.OTHER: "not an allowed CIDR nor resolved from an allowed name",
                   fn.PRIVATE: "in 10.0.0.0/8, denied by default",
                   fn.METADATA: "in 169.254.0.0/16, denied by default",
                   "127.0.0.1": "in 127.0.0.0/8, denied by default",
                   ns.address: "one of the host's own addresses",
                   "::ffff:127.0.0.1": "in 127.0.0.0/8, denied by default",
                   "fd00:ec2::254": "in fc00::/7, denied by default",
                   "fe80::1": "in fe80::/10, denied by default"}
        for address, reason in refused.items():
            verdict = policy.check(address, 7)
            assert (verdict.allowed, verdict.reason) == (False, reason), address
    assert policy.refusals()["total"] == len(refused)
    assert EgressPolicy(allow=["10.99.0.0/16"]).check(fn.PRIVATE).allowed
    assert EgressPolicy(deny=["203.0.113.0/24"]).check(fn.OTHER).allowed is False
    assert EgressPolicy().check(fn.OTHER).reason == "open egress"


def test_name_rules_and_bad_input() -> None:
    policy = EgressPolicy(allow=["*.example.test", "exact.test"], deny=["bad.example.test"])
    assert [policy.name_allowed(n) for n in ("a.example.test", "a.b.example.test", "EXACT.test.",
                                             "example.test", "x.exact.test", "bad.example.test",
                                             "notexample.test")] == [True, True, True, False, False,
                                                                     False, False]
    assert EgressPolicy(allow=["*"], deny=["*.evil.test"]).name_allowed("a.evil.test") is False
    for bad in (["*.*.test"], ["a..test"], ["300.1.2.3/8x"], [42]):
        with pytest.raises(PolicyError, match=r"profile p\.egress\.allow\[0\]"):
            EgressPolicy(allow=bad, where="profile p.egress")  # type: ignore[arg-type]


def test_dns_parsing_is_bounded() -> None:
    """Hostile bytes raise DnsFormatError (never IndexError or a hang): a pointer loop,
    a forward pointer, a truncated label, two questions; a query that does parse
    answers with its question echoed."""
    header = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0)
    for msg in (header + b"\xc0\x0c\x00\x01\x00\x01", header + b"\xc0\x20", header + b"\x05ab",
                struct.pack("!HHHHHH", 7, 0, 2, 0, 0, 0) + b"\x00\x00\x01\x00\x01" * 2, b"\x00"):
        with pytest.raises(dnswire.DnsFormatError):
            dnswire.parse_query(msg)
        assert dnswire.error_reply(msg, dnswire.RCODE_FORMERR)[3] & 0xF == dnswire.RCODE_FORMERR
    query = DNSRecord.question("Www.Example.test", "AAAA").pack()
    ident, _, q = dnswire.parse_query(query)
    assert (q.name, q.qtype, q.end) == ("www.example.test", QTYPE.AAAA, len(query))
    reply = DNSRecord.parse(dnswire.error_reply(query, dnswire.RCODE_NXDOMAIN))
    assert reply.header.id == ident and reply.header.rcode == RCODE.NXDOMAIN
    assert str(reply.q.qname) == "Www.Example.test."
    asked = DNSRecord.question("www.example.test")
    good = asked.reply()
    good.add_answer(*RR.fromZone("www.example.test. 30 A 198.51.100.10"))
    question = dnswire.parse_query(asked.pack())[2]
    assert dnswire.answer_addresses(good.pack(), question) == (0, [ipaddress.ip_address(fn.WWW)], 30)
    with pytest.raises(dnswire.DnsFormatError, match="another question"):
        dnswire.answer_addresses(DNSRecord.question("evil.test").reply().pack(), question)
