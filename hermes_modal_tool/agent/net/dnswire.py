"""The DNS wire format (RFC 1035), as much as the slot's resolver needs.

Stdlib-only, Python 3.8. Everything here reads bytes a slot or an upstream sent, so
every parse is bounded: names at most 255 bytes and 128 labels, compression pointers
only backwards (no loops), sections at most 64 records; a malformed message raises
:class:`DnsFormatError` (never ``IndexError``/``struct.error``).
"""

import ipaddress
import struct

QTYPE_A, QTYPE_AAAA, QTYPE_ANY = 1, 28, 255
RCODE_NOERROR, RCODE_FORMERR, RCODE_SERVFAIL, RCODE_NXDOMAIN, RCODE_REFUSED = 0, 1, 2, 3, 5
FLAG_QR, FLAG_TC, FLAG_RD, FLAG_RA = 0x8000, 0x0200, 0x0100, 0x0080
MAX_RECORDS = 64


class DnsFormatError(ValueError):
    """Raised when a DNS message cannot be parsed (truncated, looping, oversized)."""


class Question:
    """One question: ``name`` (lower case, no trailing dot; ``""`` for the root),
    ``qtype`` and ``qclass`` (ints), and ``end``, the offset just past it."""

    __slots__ = ("name", "qtype", "qclass", "end")

    def __init__(self, name, qtype, qclass, end):
        self.name, self.qtype, self.qclass, self.end = name, qtype, qclass, end


def read_name(msg, offset):
    """Read a (possibly compressed) name at ``offset``; returns ``(name, next_offset)``.

    ``name`` is lower case ASCII (other bytes escaped as ``\\DDD``) without the trailing
    dot. Raises :class:`DnsFormatError` on a truncated name, a forward or looping
    pointer, or a name past 255 bytes.
    """
    labels = []
    total = 0
    end = None
    pos = offset
    lowest = offset  # pointers must go strictly backwards: no loops
    for _ in range(128):
        if pos >= len(msg):
            raise DnsFormatError("name runs past the message")
        length = msg[pos]
        if length & 0xC0 == 0xC0:
            if pos + 1 >= len(msg):
                raise DnsFormatError("truncated compression pointer")
            target = ((length & 0x3F) << 8) | msg[pos + 1]
            if end is None:
                end = pos + 2
            if target >= lowest:
                raise DnsFormatError("compression pointer does not point backwards")
            lowest = pos = target
            continue
        if length & 0xC0:
            raise DnsFormatError("unknown label type")
        if length == 0:
            if end is None:
                end = pos + 1
            return ".".join(labels), end
        raw = msg[pos + 1:pos + 1 + length]
        if len(raw) != length:
            raise DnsFormatError("label runs past the message")
        total += length + 1
        if total > 255:
            raise DnsFormatError("name longer than 255 bytes")
        labels.append("".join(
            chr(b).lower() if 0x21 <= b <= 0x7E and b not in (0x2E, 0x5C) else "\\%03d" % b for b in raw))
        pos += 1 + length
    raise DnsFormatError("more than 128 labels")


def parse_query(msg):
    """The ID, flags and single question of a query; returns ``(id, flags, Question)``.

    Raises :class:`DnsFormatError` for a message shorter than its header, a response
    (QR set), or a question count other than one.
    """
    if len(msg) < 12:
        raise DnsFormatError("shorter than a DNS header")
    ident, flags, qd, an, ns, _ar = struct.unpack("!HHHHHH", msg[:12])
    if flags & FLAG_QR:
        raise DnsFormatError("a response, not a query")
    if qd != 1 or an or ns:
        raise DnsFormatError("%d questions (and %d answers, %d authority)" % (qd, an, ns))
    name, pos = read_name(msg, 12)
    if pos + 4 > len(msg):
        raise DnsFormatError("question runs past the message")
    qtype, qclass = struct.unpack("!HH", msg[pos:pos + 4])
    return ident, flags, Question(name, qtype, qclass, pos + 4)


def error_reply(query, rcode):
    """A reply to ``query`` (bytes) with ``rcode`` and no records: the header and its
    question echoed when it parses, else the bare header (ID kept when present)."""
    ident = struct.unpack("!H", query[:2])[0] if len(query) >= 2 else 0
    try:
        _, flags, question = parse_query(query)
    except DnsFormatError:
        return struct.pack("!HHHHHH", ident, FLAG_QR | FLAG_RA | rcode, 0, 0, 0, 0)
    return (struct.pack("!HHHHHH", ident, FLAG_QR | FLAG_RA | (flags & FLAG_RD) | rcode, 1, 0, 0, 0)
            + query[12:question.end])


def answer_addresses(reply, question):
    """Addresses and the smallest TTL of the ``A``/``AAAA`` answers in ``reply``.

    Args:
        reply: an upstream's reply (bytes) to a query whose question was ``question``.

    Returns:
        ``(rcode, [ipaddress objects], min_ttl)``; ``min_ttl`` is 0 with no address.
        The answers of a CNAME chain that starts at the asked name count (the slot
        asked for an allowed name; the upstream chose where it leads).

    Raises:
        DnsFormatError: the reply does not parse, is not a response, or its question is
            not ``question`` (a reply to something else).
    """
    if len(reply) < 12:
        raise DnsFormatError("reply shorter than a DNS header")
    _ident, flags, qd, an, _ns, _ar = struct.unpack("!HHHHHH", reply[:12])
    if not flags & FLAG_QR or qd != 1:
        raise DnsFormatError("not a response to one question")
    if an > MAX_RECORDS:
        raise DnsFormatError("%d answers" % an)
    name, pos = read_name(reply, 12)
    if pos + 4 > len(reply):
        raise DnsFormatError("question runs past the reply")
    if name != question.name or struct.unpack("!H", reply[pos:pos + 2])[0] != question.qtype:
        raise DnsFormatError("the reply answers another question (%r)" % name)
    pos += 4
    addresses, ttls = [], []
    for _ in range(an):
        _owner, pos = read_name(reply, pos)
        if pos + 10 > len(reply):
            raise DnsFormatError("record runs past the reply")
        rtype, _rclass, ttl, rdlen = struct.unpack("!HHIH", reply[pos:pos + 10])
        pos += 10
        rdata = reply[pos:pos + rdlen]
        if len(rdata) != rdlen:
            raise DnsFormatError("record data runs past the reply")
        pos += rdlen
        if (rtype, rdlen) in ((QTYPE_A, 4), (QTYPE_AAAA, 16)):
            addresses.append(ipaddress.ip_address(bytes(rdata)))
            ttls.append(ttl)
    return flags & 0xF, addresses, min(ttls) if ttls else 0
