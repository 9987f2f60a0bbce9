"""A slot's egress policy as nftables rules in the agent's network namespace.

Stdlib-only, Python 3.8; applied with the ``nft`` program (``nft -f -``). The slot's
namespace reaches the agent's through one veth pair (``iface`` is the agent's end);
the rules live in the agent's namespace, which the slot's root (root only in the
slot's own user namespace) cannot enter or change. One table per slot, so a slot's
rules are added and removed whole (:func:`delete_table`), and its counters are its own.

What the table does, for packets arriving from ``iface``:

- DNS (UDP/TCP port 53) to any address is redirected (DNAT) to the slot's resolver
  (:class:`.resolver.DnsResolver`, bound at ``resolver`` on the agent's end), and the
  agent's own addresses accept nothing else from the slot (``input`` hook);
- forwarded IPv4: ``deny`` CIDRs refused; ``allow`` CIDRs accepted; the default-denied
  ranges and the host's addresses refused; addresses in the ``learned`` set (what
  allowed names resolved to; :func:`learn_command` adds them with a timeout, so the
  kernel forgets them when the TTL runs out) accepted; the rest accepted only for an
  open policy. IPv6 from the slot is refused (slots get no IPv6 address yet);
- a refusal is a TCP reset or an ICMP "administratively prohibited", so ``connect``
  fails at once, and counted by the rule's counter (:func:`refusal_count` reads them);
- the slot's traffic leaves masqueraded behind the agent's address.
"""

import json

from .policy import DEFAULT_DENY

_REJECT = "meta l4proto tcp counter reject with tcp reset\n  {match} counter reject with icmpx admin-prohibited"


def table_name(slot):
    """The nftables table (family ``inet``) of slot ``slot`` (an int or short name)."""
    return "hmt_slot_%s" % slot


def _elements(nets):
    return ", ".join(str(n) for n in nets)


def slot_ruleset(slot, iface, slot_address, policy, resolver, proxy=None):
    """The ``nft -f`` script that (re)creates slot ``slot``'s table.

    Args:
        slot: the slot's number or short name (the table's suffix).
        iface: the agent's end of the slot's veth pair (an interface name).
        slot_address: the slot's IPv4 address on that pair (string).
        policy: the slot's :class:`.policy.EgressPolicy`.
        resolver: ``(address, port)`` of the slot's resolver on the agent's end.
        proxy: ``(address, port)`` of the sandbox's forward proxy (``egress.proxy``;
            :mod:`.proxy`) or None: with it the slot may reach only the proxy and its
            resolver; every forwarded connection is refused.

    Returns:
        The script (str): it deletes the table first when it exists, so applying it
        twice gives one table.
    """
    v4 = lambda nets: [n for n in nets if n.version == 4]  # noqa: E731
    deny = v4(policy.deny_nets)
    allow = v4(policy.allow_nets)
    default = v4(DEFAULT_DENY) + sorted({h for h in policy.host if h.version == 4})
    m = 'iifname "%s"' % iface
    lines = [
        "table inet {t}",
        "delete table inet {t}",
        "table inet {t} {",
        " set deny4 { type ipv4_addr; flags interval; auto-merge; %s}" % (
            "elements = { %s }; " % _elements(deny) if deny else ""),
        " set allow4 { type ipv4_addr; flags interval; auto-merge; %s}" % (
            "elements = { %s }; " % _elements(allow) if allow else ""),
        " set default4 { type ipv4_addr; flags interval; auto-merge; elements = { %s }; }" % _elements(default),
        " set learned4 { type ipv4_addr; flags timeout; }",
        " chain dns {",
        "  type nat hook prerouting priority dstnat; policy accept;",
        "  {m} meta l4proto { udp, tcp } th dport 53 counter dnat ip to {ra}:{rp}",
        " }",
        " chain to_agent {",
        "  type filter hook input priority filter; policy accept;",
        "  {m} ct state established,related accept",
        "  {m} ip daddr {ra} meta l4proto { udp, tcp } th dport {rp} accept",
    ] + (["  {m} ip daddr %s tcp dport %d accept" % proxy] if proxy else []) + [
        "  {m} " + _REJECT,
        " }",
        " chain egress {",
        "  type filter hook forward priority filter; policy accept;",
        "  {m} ct state established,related accept",
        "  {m} meta nfproto ipv6 " + _REJECT.replace("{match}", "{m} meta nfproto ipv6"),
    ] + (["  {m} " + _REJECT] if proxy else [  # proxy-only: nothing direct
        "  {m} ip daddr @deny4 " + _REJECT.replace("{match}", "{m} ip daddr @deny4"),
        "  {m} ip daddr @allow4 counter accept",
        "  {m} ip daddr @default4 " + _REJECT.replace("{match}", "{m} ip daddr @default4"),
        "  {m} ip daddr @learned4 counter accept",
        "  {m} " + ("counter accept" if policy.open else _REJECT),
    ]) + [
        " }",
        " chain out {",
        "  type nat hook postrouting priority srcnat; policy accept;",
        '  ip saddr {sa} oifname != "{i}" masquerade',
        " }",
        "}",
    ]
    text = "\n".join(lines).replace("{match}", "{m}") + "\n"
    for key, value in (("{t}", table_name(slot)), ("{m}", m), ("{i}", iface), ("{sa}", slot_address),
                       ("{ra}", str(resolver[0])), ("{rp}", str(resolver[1]))):
        text = text.replace(key, value)
    return text


def learn_command(slot, addresses, ttl):
    """The ``nft -f`` line that lets slot ``slot`` reach ``addresses`` (ipaddress
    objects; IPv6 ones are skipped) for ``ttl`` seconds (at least 1)."""
    v4 = [str(a) for a in addresses if a.version == 4]
    if not v4:
        return ""
    return "add element inet %s learned4 { %s }\n" % (
        table_name(slot), ", ".join("%s timeout %ds" % (a, max(1, int(ttl))) for a in v4))


def delete_table(slot):
    """The ``nft -f`` line that removes slot ``slot``'s table (at release)."""
    return "delete table inet %s\n" % table_name(slot)


def refusal_count(listing):
    """Packets refused by a slot's table, from ``nft -j list table inet <table>`` output
    (str): the sum of the counters of its ``reject`` rules."""
    total = 0
    for item in json.loads(listing).get("nftables", []):
        rule = item.get("rule")
        if not rule:
            continue
        exprs = rule.get("expr", [])
        if any("reject" in e for e in exprs):
            total += sum(e["counter"]["packets"] for e in exprs if "counter" in e)
    return total
