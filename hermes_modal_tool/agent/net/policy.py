"""A slot's egress policy: which names resolve and which destinations it may connect to.

Stdlib-only, Python 3.8. The agent holds one :class:`EgressPolicy` per slot, outside the
slot (the slot's root cannot change it); its resolver (:mod:`.resolver`) asks
:meth:`EgressPolicy.name_allowed` and feeds :meth:`EgressPolicy.learn` with what allowed
names resolved to, and the enforcement point (the agent's nftables rules for the slot's
veth; see the design note of issue 37) asks :meth:`EgressPolicy.check`.

Order of a connection's verdict (first match wins):

1. an address in ``deny`` CIDRs: refused;
2. an address of the default-denied ranges (:data:`DEFAULT_DENY`: loopback, the
   unspecified and broadcast addresses, link-local with the metadata endpoints,
   RFC 1918, CGNAT, ULA, multicast, IPv4-mapped/NAT64 forms of those) or of the host's
   own addresses: refused unless an ``allow`` CIDR names it;
3. an address in ``allow`` CIDRs: allowed;
4. an address an allowed name resolved to (until its TTL, clamped, runs out): allowed;
5. otherwise allowed only when the policy has no allow list at all (open egress).

Name rules: ``example.com`` matches that name only; ``*.example.com`` matches every
name below it (any depth) but not ``example.com``; ``*`` matches every name. Matching
is case-insensitive, trailing dots ignored. A name that matches ``deny`` never
resolves; with an ``allow`` name list, a name must match it to resolve.
"""

import ipaddress
import re
import threading
import time

# Where a slot must not connect unless a profile allows it (issue 37's defaults).
DEFAULT_DENY = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "127.0.0.0/8", "255.255.255.255/32",             # this host, loopback, broadcast
    "169.254.0.0/16",                                              # link-local, 169.254.169.254
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",               # RFC 1918
    "100.64.0.0/10",                                               # CGNAT (provider-internal)
    "224.0.0.0/4", "240.0.0.0/4",                                  # multicast, reserved
    "::/128", "::1/128", "fe80::/10", "fc00::/7", "ff00::/8",      # unspecified, loopback, link-local, ULA, multicast
    "fd00:ec2::254/128",                                           # AWS's IPv6 metadata endpoint (in fc00::/7 too)
))
_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
MIN_TTL, MAX_TTL = 30, 3600  # seconds a resolved address stays allowed
MAX_LEARNED = 4096  # addresses remembered per slot (oldest expiry dropped first)
MAX_REFUSED_KEYS = 64  # distinct refused destinations counted by name; the rest in "other"


class PolicyError(ValueError):
    """Raised when a policy's CIDR or name pattern is malformed (the message names it)."""


class Verdict:
    """A connection's verdict: ``allowed`` (bool) and ``reason`` (a short phrase)."""

    __slots__ = ("allowed", "reason")

    def __init__(self, allowed, reason):
        self.allowed, self.reason = allowed, reason

    def __repr__(self):
        return "Verdict(%r, %r)" % (self.allowed, self.reason)


def normalize_name(name):
    """``name`` in lower case without its trailing dot."""
    return name.strip().lower().rstrip(".")


def _parse_network(text, where):
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise PolicyError("%s: %r is not an IP network (CIDR like 203.0.113.0/24)" % (where, text)) from None


def _parse_pattern(text, where):
    name = normalize_name(text)
    if name == "*":
        return name
    bare = name[2:] if name.startswith("*.") else name
    labels = bare.split(".")
    if not bare or not all(_LABEL.match(label) for label in labels) or labels[-1].isdigit():
        raise PolicyError("%s: %r is neither an IP network (CIDR) nor a domain name or "
                          "*.domain pattern" % (where, text))
    return name


def name_matches(name, pattern):
    """Whether normalized ``name`` matches one normalized ``pattern`` (see the module doc)."""
    if pattern == "*":
        return True
    if pattern.startswith("*."):
        return name.endswith(pattern[1:])
    return name == pattern


def unmapped(address):
    """The IPv4 address behind an IPv4-mapped (``::ffff:a.b.c.d``) or NAT64
    (``64:ff9b::a.b.c.d``) IPv6 address, else ``address`` itself."""
    if address.version == 6:
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class EgressPolicy:
    """One slot's egress rules and what it has been refused. Thread-safe.

    Args:
        allow: CIDRs and name patterns to allow (strings; a string that parses as a
            network is a CIDR, else a name pattern).
        deny: the same, to refuse; deny wins over allow.
        host_addresses: the host's own addresses (strings), refused by default like
            loopback (see :func:`.hostaddrs.host_addresses`).
        where: where the lists came from, for error messages (a profile's name).

    Raises:
        PolicyError: a malformed CIDR or pattern, naming it and ``where``.
    """

    def __init__(self, allow=(), deny=(), host_addresses=(), where="egress"):
        self.allow_nets, self.allow_names = self._split(allow, where + ".allow")
        self.deny_nets, self.deny_names = self._split(deny, where + ".deny")
        self.host = frozenset(ipaddress.ip_address(a) for a in host_addresses)
        self.open = not self.allow_nets and not self.allow_names
        self._lock = threading.Lock()
        self._learned = {}  # ip address -> (expiry monotonic, name)
        self._refused = {}  # "ip:port" or "name" -> count
        self._refused_total = 0

    @staticmethod
    def _split(items, where):
        nets, names = [], []
        for k, item in enumerate(items):
            if not isinstance(item, str):
                raise PolicyError("%s[%d]: %r is not a string" % (where, k, item))
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                names.append(_parse_pattern(item, "%s[%d]" % (where, k)))
            else:
                nets.append(_parse_network(item, "%s[%d]" % (where, k)))
        return tuple(nets), tuple(names)

    def name_allowed(self, name):
        """Whether ``name`` may resolve; a refusal is counted under the name."""
        name = normalize_name(name)
        if any(name_matches(name, p) for p in self.deny_names):
            allowed = False
        else:
            allowed = self.open or any(name_matches(name, p) for p in self.allow_names)
        if not allowed:
            self._count(name or ".")
        return allowed

    def learn(self, name, addresses, ttl, now=None):
        """Remember ``addresses`` (ipaddress objects) that allowed ``name`` resolved to,
        for ``ttl`` seconds clamped to [:data:`MIN_TTL`, :data:`MAX_TTL`]."""
        expiry = (time.monotonic() if now is None else now) + min(max(ttl, MIN_TTL), MAX_TTL)
        with self._lock:
            for address in addresses:
                self._learned[unmapped(address)] = (expiry, normalize_name(name))
            if len(self._learned) > MAX_LEARNED:
                for address, _ in sorted(self._learned.items(), key=lambda kv: kv[1][0])[
                        :len(self._learned) - MAX_LEARNED]:
                    del self._learned[address]

    def learned(self, now=None):
        """``{address string: name}`` of the resolved addresses still allowed."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return {str(a): n for a, (exp, n) in self._learned.items() if exp > now}

    def check(self, address, port=None, now=None, count=True):
        """The :class:`Verdict` for a connection to ``address`` (string or ipaddress
        object) and ``port`` (int, or None); a refusal is counted unless ``count`` is
        false. An unparsable address is refused."""
        try:
            ip = unmapped(ipaddress.ip_address(address))
        except ValueError:
            verdict = Verdict(False, "not an IP address")
        else:
            verdict = self._verdict(ip, now)
        if not verdict.allowed and count:
            self._count("%s:%s" % (address, port) if port is not None else str(address))
        return verdict

    def _verdict(self, ip, now):
        if any(ip in n for n in self.deny_nets):
            return Verdict(False, "denied by the profile's deny list")
        allowed_net = any(ip in n for n in self.allow_nets)
        if not allowed_net:
            if ip in self.host:
                return Verdict(False, "one of the host's own addresses")
            for net in DEFAULT_DENY:
                if ip in net:
                    return Verdict(False, "in %s, denied by default" % net)
            if ip.version == 6 and ip.sixtofour is not None and self._verdict(ip.sixtofour, now).allowed is False:
                return Verdict(False, "6to4 form of a refused address")
        if allowed_net:
            return Verdict(True, "in the profile's allow list")
        now = time.monotonic() if now is None else now
        with self._lock:
            seen = self._learned.get(ip)
        if seen is not None and seen[0] > now:
            return Verdict(True, "resolved from %s" % seen[1])
        if self.open:
            return Verdict(True, "open egress")
        return Verdict(False, "not an allowed CIDR nor resolved from an allowed name")

    def _count(self, key):
        with self._lock:
            self._refused_total += 1
            if key in self._refused or len(self._refused) < MAX_REFUSED_KEYS:
                self._refused[key] = self._refused.get(key, 0) + 1
            else:
                self._refused["other"] = self._refused.get("other", 0) + 1

    def refusals(self, reset=False):
        """``{"total": int, "by_destination": {key: count}}`` of refused names and
        connections (at most :data:`MAX_REFUSED_KEYS` keys, then ``"other"``); with
        ``reset``, the counts start again from zero (for "since the last result")."""
        with self._lock:
            out = {"total": self._refused_total, "by_destination": dict(self._refused)}
            if reset:
                self._refused_total = 0
                self._refused = {}
        return out
