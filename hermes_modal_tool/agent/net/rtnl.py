"""Links, addresses and routes of a slot's network, set over rtnetlink in-process.

Stdlib-only, Python 3.8. What ``ip link add ... type veth peer ... netns``, ``ip addr
add``, ``ip link set up``, ``ip route add default via`` and ``ip link del`` do, without
a process each (an ``ip`` process costs 10 to 20 ms; a message here a few µs). A
:class:`Rtnl` socket belongs to the network namespace of the thread that opened it
(the kernel binds a netlink socket to its creator's namespace for its whole life), so
it is opened inside :func:`.netns.entered`, which checks the namespace first, and
acts on that namespace only, whichever thread uses it afterwards.
"""

import os
import socket
import struct

NETLINK_ROUTE = 0
RTM_NEWLINK, RTM_DELLINK, RTM_NEWADDR, RTM_NEWROUTE = 16, 17, 20, 24
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
NLMSG_ERROR = 2
IFF_UP = 0x1
IFLA_IFNAME, IFLA_MTU, IFLA_LINKINFO, IFLA_NET_NS_FD = 3, 4, 18, 28
IFLA_INFO_KIND, IFLA_INFO_DATA, VETH_INFO_PEER = 1, 2, 1
IFA_ADDRESS, IFA_LOCAL = 1, 2
RTA_GATEWAY = 5
RT_TABLE_MAIN, RTPROT_BOOT, RT_SCOPE_UNIVERSE, RTN_UNICAST = 254, 3, 0, 1
_NESTED = 0x8000


def _attr(kind, payload):
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _ifinfo(index=0, up=False):
    return struct.pack("=BxHiII", socket.AF_UNSPEC, 0, index, IFF_UP if up else 0, IFF_UP if up else 0)


def _name(name):
    return _attr(IFLA_IFNAME, name.encode() + b"\0")


class Rtnl:
    """An rtnetlink socket of the calling thread's network namespace.

    Every request waits for the kernel's answer; a refusal raises ``OSError`` with the
    kernel's errno and what was asked.
    """

    def __init__(self):
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE)
        self.sock.bind((0, 0))
        self.seq = 0

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _ask(self, kind, flags, body, what):
        self.seq += 1
        head = struct.pack("=IHHII", 16 + len(body), kind, NLM_F_REQUEST | NLM_F_ACK | flags, self.seq, 0)
        self.sock.send(head + body)
        while True:
            data = self.sock.recv(65536)
            at = 0
            while at + 16 <= len(data):
                length, mtype, _flags, seq, _pid = struct.unpack_from("=IHHII", data, at)
                if mtype == NLMSG_ERROR and seq == self.seq:
                    error = struct.unpack_from("=i", data, at + 16)[0]
                    if error:
                        raise OSError(-error, "%s: %s" % (what, os.strerror(-error)))
                    return
                at += max(length + (-length % 4), 16)

    def veth(self, name, peer, peer_netns_fd, up=True):
        """``ip link add name <name> type veth peer name <peer> netns <fd>`` (``name`` up).

        ``peer_netns_fd``: a descriptor of the namespace the peer is made in."""
        peer_info = _ifinfo() + _name(peer) + _attr(IFLA_NET_NS_FD, struct.pack("=I", peer_netns_fd))
        data = _attr(VETH_INFO_PEER | _NESTED, peer_info)
        info = _attr(IFLA_INFO_KIND, b"veth\0") + _attr(IFLA_INFO_DATA | _NESTED, data)
        self._ask(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, _ifinfo(up=up) + _name(name)
                  + _attr(IFLA_LINKINFO | _NESTED, info), "veth %s" % name)

    def up(self, name):
        """``ip link set <name> up``."""
        self._ask(RTM_NEWLINK, 0, _ifinfo(up=True) + _name(name), "link %s up" % name)

    def delete(self, name):
        """``ip link del <name>``."""
        self._ask(RTM_DELLINK, 0, _ifinfo() + _name(name), "link del %s" % name)

    def address(self, name, address, prefix):
        """``ip addr add <address>/<prefix> dev <name>`` (IPv4)."""
        index = socket.if_nametoindex(name)  # an ioctl in this thread's (the same) namespace
        packed = socket.inet_aton(address)
        body = struct.pack("=BBBBI", socket.AF_INET, prefix, 0, RT_SCOPE_UNIVERSE, index)
        self._ask(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, body + _attr(IFA_LOCAL, packed)
                  + _attr(IFA_ADDRESS, packed), "addr %s/%d on %s" % (address, prefix, name))

    def default_route(self, gateway):
        """``ip route add default via <gateway>`` (IPv4, the main table)."""
        body = struct.pack("=BBBBBBBBI", socket.AF_INET, 0, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT,
                           RT_SCOPE_UNIVERSE, RTN_UNICAST, 0)
        self._ask(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, body + _attr(RTA_GATEWAY, socket.inet_aton(gateway)),
                  "default route via %s" % gateway)
