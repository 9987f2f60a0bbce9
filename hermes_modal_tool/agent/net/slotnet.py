"""``network: egress``: a network namespace per slot behind a router namespace per sandbox.

Stdlib-only, Python 3.8. The layout (local driver; the agent runs in the host's
network namespace, where nothing of this is ever configured):

- the sandbox's *router* namespace, made by the agent (``unshare(CLONE_NEWNET)`` in a
  throwaway thread, held by a descriptor) and owned by the agent's user namespace. It
  reaches the network through ``slirp4netns`` (user-mode: the host's own sockets, no
  rule in the host, the host's loopback not mapped) or, with ``upstream: none``,
  through whatever the caller attaches
  (tests: the fake internet). It forwards and masquerades the slots' traffic;
- one namespace per slot, made the same way, so owned by the agent's user namespace
  too: the slot's root (root only in the slot's own user namespace) has no
  capability over it and can change neither its routes nor its addresses nor any
  nftables rule. bwrap starts in it (:meth:`SandboxNet.entered` around the spawn)
  instead of making a namespace of its own;
- a veth pair per slot (``hs<N>`` in the router, ``eth0`` in the slot's, a /30 of
  10.254.0.0/16), the slot's nftables table in the router
  (:func:`.nftrules.slot_ruleset`) and its resolver (:class:`.resolver.DnsResolver`)
  bound on the router's end, where every DNS packet of the slot is redirected.

Every ``ip``/``nft`` command runs in a child that first enters the router's or the
slot's namespace and checks, before exec, that it is in it (else it exits 121 and
nothing runs): none can act on the host's namespace. :meth:`SandboxNet.release`
removes a slot's table, veth pair and resolver and drops its namespace;
:meth:`SandboxNet.close` everything.
"""

import contextlib
import os
import shutil
import subprocess
import threading

from . import hostaddrs, nftlib, nftrules, proxy
from .netns import TOOL_PATH, NetError, entered, new_netns, own_inode, pdeathsig, run_in
from .policy import EgressPolicy
from .resolver import DnsResolver
from .rtnl import Rtnl


def network_mode(value):
    """``"none"``, ``"egress"`` or ``"host"`` from a config value (``True`` is
    ``"egress"``, ``False`` ``"none"``: the profile's aliases, see network_config.py).

    Raises:
        ValueError: any other value (named).
    """
    if value is True or value is False:
        return "egress" if value else "none"
    if value in ("none", "egress", "host"):
        return value
    raise ValueError("network must be 'none', 'egress' or 'host', got %r" % (value,))


def _tool(name):
    path = shutil.which(name, path=TOOL_PATH + ":" + os.environ.get("PATH", ""))
    if path is None:
        raise NetError("network: egress needs %r on the sandbox's PATH (Debian: apt-get install "
                       "%s)" % (name, {"nft": "nftables"}.get(name, name)))
    return path


#: slirp4netns's own resolver (it forwards to the host's, loopback ones included).
SLIRP_DNS = ("10.0.2.3", 53)


def upstream_dns(resolv_conf="/etc/resolv.conf", slirp=False):
    """``(address, 53)`` of the first IPv4 nameserver of ``resolv_conf``, or None. With
    ``slirp`` (the router's upstream is slirp4netns) a loopback nameserver (systemd-resolved's
    127.0.0.53), or none at all, gives :data:`SLIRP_DNS`: the router cannot reach the host's
    loopback, slirp4netns asks it from the host's namespace."""
    try:
        with open(resolv_conf) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver" and ":" not in parts[1]:
                    if slirp and parts[1].startswith("127."):
                        return SLIRP_DNS
                    return parts[1], 53
    except OSError:
        pass
    return SLIRP_DNS if slirp else None


def start_or_degrade(options, where, explicit):
    """Start a sandbox's :class:`SandboxNet` for ``network: egress``; returns ``(net, "")``.

    Where it cannot start (the agent is not root, so no network namespace of its own;
    no nftables in the kernel or on the host; ``slirp4netns`` missing; no resolver) and the profile left
    ``network`` unset (``explicit`` false), returns ``(None, why)`` instead: the slots
    run with ``network: none`` (loopback only; never the host's network) and ``why``
    is shown in the sandbox's status. With ``network: egress`` set explicitly the
    error is raised.

    Raises:
        NetError: it could not start and ``explicit`` (the message says why and what to set).
    """
    net = None
    try:
        net = SandboxNet(options, where)
        return net.start(), ""
    except (OSError, NetError) as exc:
        if net is not None:
            net.close()
        why = str(exc)
        if isinstance(exc, OSError) and exc.errno == 1:
            why = ("the agent cannot make a network namespace (it runs as uid %d, not root: "
                   "unshare(CLONE_NEWNET) was refused)" % os.geteuid())
        if explicit:
            raise NetError("network: egress could not start: %s; run the sandbox's agent as "
                           "root, or set network: none (or host) in the profile" % why) from None
        return None, ("network: egress (the default) is not available here, so the slots have "
                      "no network (none): %s. Set network: host in the profile for the "
                      "sandbox's network, or none to silence this" % why)


def slot_addresses(index):
    """``(router end, slot end)`` of slot ``index``'s /30 in 10.254.0.0/16."""
    base = 4 * index
    return ("10.254.%d.%d" % (base // 256, base % 256 + 1), "10.254.%d.%d" % (base // 256, base % 256 + 2))


class SlotNet:
    """One slot's namespace, veth pair, table and resolver (see :class:`SandboxNet`)."""

    def __init__(self, index, fd, inode, policy, resolver):
        self.index, self.fd, self.inode = index, fd, inode
        self.policy, self.resolver = policy, resolver


class SandboxNet:
    """A sandbox's router namespace and its slots' namespaces (``network: egress``).

    Args:
        options: the profile's ``egress`` mapping (``allow``, ``deny``: lists of CIDRs
            and name patterns; ``dns``: ``"address[:port]"`` or None for the host's
            first nameserver; ``upstream``: ``"slirp4netns"`` or ``"none"``).
        where: where ``options`` came from, for errors (the profile).

    Raises:
        .policy.PolicyError: a bad allow/deny entry (named, with ``where``).
    """

    def __init__(self, options, where="egress"):
        options = options or {}
        self.allow = list(options.get("allow") or ())
        self.deny = list(options.get("deny") or ())
        EgressPolicy(self.allow, self.deny, where=where)  # bad entries fail at init
        dns = options.get("dns")
        if dns:
            host, _, port = dns.partition(":")
            self.dns = (host, int(port or 53))
        else:
            self.dns = upstream_dns(slirp=(options.get("upstream") or "slirp4netns") == "slirp4netns")
        self.upstream = options.get("upstream") or "slirp4netns"
        self.proxy_only = bool(options.get("proxy"))
        self.proxy = None  # the ForwardProxy, with proxy_only
        self._by_address = {}  # slot address -> index (the proxy's slot_of)
        self.host = hostaddrs.host_addresses()  # read here, in the agent's (host's) namespace
        self.router = None  # (fd, inode)
        self.slots = {}
        self._lock = threading.Lock()
        self._upstream = None
        self._nft = None  # nftlib.Nft made in the router (None: the nft program)
        self.nft_path = None  # the nft program, where libnftables is missing
        self.refused_released = 0  # refusals of slots already released
        self._released_counts = {}  # index -> the last tenant's refusals, until its reset answers

    @property
    def router_path(self):
        """``/proc/<agent pid>/fd/<n>``: the router namespace, for ``nsenter --net=``."""
        return "/proc/%d/fd/%d" % (os.getpid(), self.router[0]) if self.router else None

    def start(self):
        """Make the router namespace (forwarding on) and start its upstream. Blocking.

        Raises:
            NetError: no resolver to ask, or the upstream did not start.
            OSError: the kernel refused the namespace (the agent is not root).
        """
        if self.dns is None:
            raise NetError("network: egress has no resolver to ask: set egress.dns in the profile")
        fd, inode = self.router = new_netns()
        if inode == own_inode():  # pragma: no cover - unshare made no new namespace
            raise NetError("the router namespace is the agent's own")
        with entered(fd, inode):  # sockets made here are the router's, for their whole life
            with Rtnl() as rtnl:
                rtnl.up("lo")
                if self.proxy_only:
                    rtnl.address("lo", proxy.ADDRESS, 32)
            nftlib.kernel_check()  # before libnftables, which exits the process without it
            self._nft = nftlib.open_nft()
            # /proc/sys/net is the namespace of the thread that opens it: the router's
            with open("/proc/sys/net/ipv4/ip_forward", "w") as fh:
                fh.write("1")
        if self._nft is None:
            self.nft_path = _tool("nft")  # NetError naming the package when it is missing too
        self.nft("list tables")  # nf_tables itself answers (NetError where it does not)
        if self.proxy_only:
            with entered(fd, inode):  # its socket and threads in the router
                self.proxy = proxy.ForwardProxy(self._slot_of).start()
        if self.upstream == "slirp4netns":
            # The router's fd, inherited at its number: slirp4netns enters the namespace
            # through /proc/self/fd/<n> (pasta cannot open its tap in a namespace it did
            # not make when run as root). No mapping of the host's loopback (10.0.2.2).
            ready_r, ready_w = os.pipe()
            try:
                self._upstream = subprocess.Popen(
                    [_tool("slirp4netns"), "--configure", "--disable-host-loopback", "--mtu", "65520",
                     "--ready-fd", str(ready_w), "--netns-type=path", "/proc/self/fd/%d" % fd, "tap0"],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                    pass_fds=(fd, ready_w), preexec_fn=pdeathsig)
                os.close(ready_w)
                ready_w = None
                ready = os.read(ready_r, 1)  # "1" once tap0 is configured; EOF if it died
            finally:
                os.close(ready_r)
                if ready_w is not None:
                    os.close(ready_w)
            if ready != b"1":
                self._upstream.kill()
                why = self._upstream.communicate(timeout=5)[1]
                raise NetError("slirp4netns did not start for the sandbox's router: %s" % (
                    why.decode("utf-8", "replace").strip()[-300:],))
            self._upstream.stderr.close()
        return self

    def _slot_of(self, address):
        net = self.slots.get(self._by_address.get(address, -1))
        return (net.policy, net.resolver) if net is not None else None

    def nft(self, text, json=False):
        """Run nftables ``text`` in the router's namespace (``libnftables`` in-process, else
        the ``nft`` program); returns its output (JSON with ``json``).

        Raises:
            NetError: nftables refused it, or the router is gone.
        """
        if self.router is None:
            raise NetError("the sandbox's router namespace is gone")
        if self._nft is None:
            return run_in(self.router[0], self.router[1],
                          [self.nft_path, *(("-j",) if json else ()), "-f", "-"], text)
        try:
            with entered(*self.router):  # the context was made here; every command runs here
                return self._nft.run(text, json)
        except (RuntimeError, OSError) as exc:
            raise NetError("nft failed: %s" % exc) from None

    def acquire(self, index):
        """Slot ``index``'s namespace, set up on first use; returns its :class:`SlotNet`.
        Blocking (a few ``ip``/``nft`` commands): call from a worker thread.

        Raises:
            NetError, OSError: it could not be set up (the slot must not start then).
        """
        with self._lock:
            net = self.slots.get(index)
            if net is not None:
                return net
            if self.router is None:
                raise NetError("the sandbox's router namespace is gone")
            if self.dns is None:
                raise NetError("network: egress has no resolver to ask: set egress.dns in the profile")
            fd, inode = new_netns()
            ours, theirs = slot_addresses(index)
            iface = "hs%d" % index
            policy = EgressPolicy(self.allow, self.deny, host_addresses=self.host)
            resolver = None
            try:
                with entered(*self.router), Rtnl() as rtnl:  # the router's end
                    rtnl.veth(iface, "eth0", fd)
                    rtnl.address(iface, ours, 30)
                with entered(fd, inode), Rtnl() as rtnl:  # the slot's end
                    rtnl.up("lo")
                    rtnl.address("eth0", theirs, 30)
                    rtnl.up("eth0")
                    rtnl.default_route(ours)

                def learned(_name, addresses, ttl, index=index):
                    command = nftrules.learn_command(index, addresses, ttl)
                    if command:
                        self.nft(command)

                with entered(*self.router):  # its sockets (and threads) in the router
                    resolver = DnsResolver(policy, self.dns, bind=(ours, 53), on_learn=learned).start()
                self.nft(nftrules.slot_ruleset(
                    index, iface, theirs, policy, resolver.address,
                    proxy=(proxy.ADDRESS, proxy.PORT) if self.proxy_only else None))
            except BaseException:
                if resolver is not None:
                    resolver.close()
                self._drop(index, fd)
                raise
            net = self.slots[index] = SlotNet(index, fd, inode, policy, resolver)
            self._by_address[theirs] = index
            return net

    @contextlib.contextmanager
    def entered(self, index):
        """The calling thread in slot ``index``'s namespace (set up first) for the block:
        a process it starts (bwrap) starts there."""
        net = self.acquire(index)
        with entered(net.fd, net.inode):
            yield net

    def refusals(self, index):
        """Refusals of slot ``index`` so far: ``{"names": n, "connections": n}`` (names
        answered NXDOMAIN by its resolver; packets its table refused)."""
        net = self.slots.get(index)
        return self.refusals_of(net) if net is not None else {"names": 0, "connections": 0}

    def _proxy_refused(self, index):
        if self.proxy is None:
            return 0
        return self.proxy.refused.get(slot_addresses(index)[1], 0)

    def reset_result(self, index):
        """What a reset of slot ``index`` answers: ``{"network_refused": {"names": n,
        "connections": n}}``, the refusals of the tenant it ends (read from the table while
        it exists: one ``nft`` listing, a few ms; the host adds them to its pool's
        ``network_refused``)."""
        counts = self._released_counts.pop(index, None)
        return {"network_refused": counts if counts is not None else self.refusals(index)}

    def release(self, index):
        """Remove slot ``index``'s table, veth pair and resolver and drop its namespace
        (the next tenant gets a new one). Blocking; idempotent."""
        with self._lock:
            net = self.slots.pop(index, None)
            if net is None:
                return
            counts = self.refusals_of(net)
            self.refused_released += counts["names"] + counts["connections"]
            address = slot_addresses(index)[1]
            self._by_address.pop(address, None)
            if self.proxy is not None:
                with self.proxy._lock:
                    self.proxy.refused.pop(address, None)  # the next tenant counts afresh
            self._released_counts[index] = counts
            net.resolver.close()
            self._drop(index, net.fd)

    def refusals_of(self, net):
        """:meth:`refusals` of the :class:`SlotNet` ``net`` (one listing of its table)."""
        try:
            listing = self.nft("list table inet %s" % nftrules.table_name(net.index), json=True)
            connections = nftrules.refusal_count(listing)
        except (NetError, ValueError):
            connections = 0
        return {"names": net.resolver.refused, "connections": connections + self._proxy_refused(net.index)}

    def _drop(self, index, fd):
        try:
            self.nft(nftrules.delete_table(index))
        except NetError:
            pass  # never made
        if self.router is not None:
            try:
                with entered(*self.router), Rtnl() as rtnl:
                    rtnl.delete("hs%d" % index)
            except OSError:
                pass  # never made
        os.close(fd)

    def status(self):
        """What ``get_status()`` shows: the mode, the policy and the refusals per slot."""
        return {"mode": "egress", "allow": self.allow, "deny": self.deny,
                "dns": "%s:%d" % self.dns if self.dns else None, "upstream": self.upstream,
                "proxy": "%s:%d" % (proxy.ADDRESS, proxy.PORT) if self.proxy_only else None,
                "enforced_by": "nftables in the sandbox's router namespace (outside the slots' "
                               "user namespaces); DNS by the agent's resolver",
                "refused": {str(i): self.refusals(i) for i in sorted(self.slots)},
                "refused_released": self.refused_released}

    def close(self):
        """Release every slot, stop the upstream, drop the router namespace. Idempotent."""
        for index in list(self.slots):
            try:
                self.release(index)
            except (NetError, OSError):
                pass
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None
        if self._upstream is not None:
            self._upstream.kill()
            self._upstream.wait()
            self._upstream = None
        if self._nft is not None:
            self._nft.close()
            self._nft = None
        if self.router is not None:
            os.close(self.router[0])
            self.router = None
