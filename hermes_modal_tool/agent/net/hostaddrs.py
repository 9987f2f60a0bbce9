"""The addresses of this network namespace's own interfaces, from ``/proc``.

Stdlib-only, Python 3.8. The egress defaults refuse the host's own addresses (a slot
must not reach a service the host binds to its public address any more than one on
127.0.0.1); the agent reads them in the host's namespace when it starts. IPv4 comes
from the ``LOCAL`` leaves of ``/proc/net/fib_trie``, IPv6 from ``/proc/net/if_inet6``.
"""

import ipaddress


def host_addresses(fib_trie="/proc/net/fib_trie", if_inet6="/proc/net/if_inet6"):
    """Sorted strings of the local addresses (IPv4 and IPv6) of the calling thread's
    network namespace; a file that cannot be read contributes nothing."""
    found = set()
    try:
        with open(fib_trie) as fh:
            previous = ""
            for line in fh:
                text = line.strip()
                if text.startswith("/32 host LOCAL") and previous.startswith("|-- "):
                    found.add(ipaddress.ip_address(previous[4:]))
                previous = text
    except (OSError, ValueError):
        pass
    try:
        with open(if_inet6) as fh:
            for line in fh:
                hexaddr = line.split()[0] if line.split() else ""
                if len(hexaddr) == 32:
                    found.add(ipaddress.IPv6Address(int(hexaddr, 16)))
    except (OSError, ValueError):
        pass
    return sorted(str(a) for a in found)
