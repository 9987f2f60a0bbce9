"""A fake internet on this machine, for network tests: nothing leaves the machine.

:class:`FakeInternet` starts a server process in a network namespace of its own
(``unshare --net``) whose only interface is ``lo``, holding non-private
documentation addresses (RFC 5737), plus two stand-ins that the egress defaults must
refuse (a private address and the cloud metadata address)::

    198.51.100.10  www.example.test   HTTP 80, HTTPS 443 (test CA), echo 7, source 19
    198.51.100.11  api.example.test   the same services (every address serves all)
    198.51.100.20  pypi.example.test  a PEP 503 index at /simple/ with one wheel
    198.51.100.53  ns.example.test    DNS on 53 (UDP, TCP) for the names here
    203.0.113.10   other.test         an address outside any allow-list
    10.99.0.10     private.example.test, rebind.example.test (RFC 1918 stand-in)
    169.254.169.254                   the metadata endpoint's address

Clients reach it through namespaces :meth:`FakeInternet.netns` makes (a veth pair
into the fake internet, routes for its ranges only) or, for a namespace the test owns
otherwise, :meth:`FakeInternet.attach`. The fake internet has no default route and
does not forward, and every route of every namespace it touches is checked to stay
inside its ranges (:meth:`FakeInternet.check_routes`): it cannot route to a real
address. Everything (server, namespaces, interfaces) goes when :meth:`stop` runs or
the test process dies (the namespaces belong to child processes that die with it).

Needs root (``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN``), ``ip`` and ``unshare`` from
iproute2/util-linux, and the ``dnslib`` and ``cryptography`` packages (dev extras).
:func:`fake_internet` is a pytest fixture body: ``yield from fake_internet(tmp)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from hermes_modal_tool.testing import _fakenet_files

ZONE: dict[str, list[str]] = {
    "www.example.test": ["198.51.100.10"],
    "api.example.test": ["198.51.100.11"],
    "pypi.example.test": ["198.51.100.20"],
    "ns.example.test": ["198.51.100.53"],
    "other.test": ["203.0.113.10"],
    "private.example.test": ["10.99.0.10"],
    "rebind.example.test": ["10.99.0.10"],
}
WWW, API, PYPI, DNS, OTHER = "198.51.100.10", "198.51.100.11", "198.51.100.20", "198.51.100.53", "203.0.113.10"
PRIVATE, METADATA = "10.99.0.10", "169.254.169.254"
ADDRESSES = [WWW, API, PYPI, DNS, OTHER, PRIVATE, METADATA]
# What a namespace attached to the fake internet may route to: its public ranges,
# and (only in namespaces the fake internet made, never the host's) the stand-ins.
PUBLIC_RANGES = ("198.51.100.0/24", "203.0.113.0/24")
STANDIN_RANGES = (f"{PRIVATE}/32", f"{METADATA}/32")
GATEWAY = "203.0.113.1"  # the fake internet's end of every veth pair
CLONE_NEWNET = 0x40000000


class FakenetError(RuntimeError):
    """Raised when the fake internet cannot start, or a namespace would route elsewhere."""


def _run(*argv: str, netns: str | None = None) -> str:
    cmd = (["nsenter", f"--net={netns}", "--"] if netns else []) + list(argv)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if proc.returncode != 0:
        raise FakenetError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


class NetNs:
    """A network namespace held by a child process (``unshare --net cat``).

    ``path`` is ``/proc/<pid>/ns/net``; :meth:`run` runs a command in it (``nsenter``),
    :meth:`enter` moves the calling thread into it for a ``with`` block (sockets made
    there stay in it). :meth:`close` ends the holder, and so the namespace with its
    interfaces (unless another process still lives in it).
    """

    def __init__(self, address: str | None = None, *, userns: bool = False) -> None:
        # With ``userns``, the namespace belongs to a user namespace of its own (as a
        # slot's does under bubblewrap): :meth:`run_as_owner` runs as root there.
        self.userns = userns
        self._proc = subprocess.Popen(
            ["unshare", *(["--user", "--map-root-user"] if userns else []), "--net", "--", "cat"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        )
        self.pid = self._proc.pid
        self.path = f"/proc/{self.pid}/ns/net"
        wait_unshared(self.pid)
        self.address = address  # its address on the fake internet, once attached
        self.ifname = ""  # its end of the veth pair, once attached
        self._tmp: str | None = None
        _run("ip", "link", "set", "lo", "up", netns=self.path)

    def run(
        self, *argv: str, nameserver: str | None = None, timeout: float = 60, **kw: object
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in this namespace; returns the completed process (text output).

        With ``nameserver`` (an address), the command sees an ``/etc/resolv.conf``
        naming only it (bound over the real one in a private mount namespace).
        """
        cmd = ["nsenter", f"--net={self.path}", "--"]
        if nameserver is not None:
            if self._tmp is None:
                self._tmp = tempfile.mkdtemp(prefix="fakenet-resolv-")
            conf = Path(self._tmp) / f"resolv-{nameserver}.conf"
            conf.write_text(f"nameserver {nameserver}\noptions timeout:2 attempts:1\n")
            cmd += ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                    'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(conf)]
        cmd += argv
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload,no-any-return]

    def run_as_owner(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` as root of the namespace's own user namespace (``userns=True``):
        all capabilities over this network namespace, none over any other."""
        if not self.userns:
            raise FakenetError("run_as_owner needs a NetNs made with userns=True")
        cmd = ["nsenter", "-t", str(self.pid), "-U", "-n", "--", *argv]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        """Move the calling thread into this namespace for the ``with`` block."""
        with enter_netns(self.path):
            yield

    def close(self) -> None:
        """End the holder (and so the namespace); idempotent."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(timeout=10)
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def wait_unshared(pid: int, timeout: float = 5) -> None:
    """Wait until process ``pid`` is in a network namespace other than ours.

    ``unshare --net CMD`` is still in our namespace for a moment after it started:
    configuring ``/proc/<pid>/ns/net`` then would configure this one (the host's).

    Raises:
        FakenetError: it did not leave our namespace within ``timeout`` seconds.
    """
    ours = os.stat("/proc/self/ns/net").st_ino
    deadline = time.monotonic() + timeout
    while os.stat(f"/proc/{pid}/ns/net").st_ino == ours:
        if time.monotonic() > deadline:
            raise FakenetError(f"process {pid} did not leave this network namespace in {timeout}s")
        time.sleep(0.002)


def wait_carrier(netns: str, ifname: str, timeout: float = 5) -> None:
    """Wait until ``ifname`` in the namespace at ``netns`` is up with a carrier (a
    veth's comes up asynchronously; a connect before it fails at once).

    Raises:
        FakenetError: not up within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while json.loads(_run("ip", "-j", "link", "show", ifname, netns=netns))[0].get("operstate") != "UP":
        if time.monotonic() > deadline:
            raise FakenetError(f"{ifname} in {netns} did not come up within {timeout}s")
        time.sleep(0.01)


@contextlib.contextmanager
def enter_netns(path: str) -> Iterator[None]:
    """``setns(2)`` the calling thread into the network namespace at ``path``, and back."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
    target = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({path})")
        try:
            yield
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:  # pragma: no cover - the kernel let us in
                raise OSError(ctypes.get_errno(), "setns back to the thread's namespace")
    finally:
        os.close(target)
        os.close(home)


class FakeInternet:
    """The fake internet's server and the namespaces attached to it. See the module doc.

    Args:
        workdir: an empty directory for the CA, the certificate, the index and the log.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.ca: Path = workdir / "ca.pem"
        self.index = workdir / "index"
        self._proc: subprocess.Popen[bytes] | None = None
        self._clients: list[NetNs] = []
        self._links: list[tuple[str, str]] = []  # (namespace path, interface) we added
        self._next = 100
        self.path = ""

    def start(self, timeout: float = 20) -> FakeInternet:
        """Start the server process; returns ``self`` once every service answers.

        Raises:
            FakenetError: not root, a tool missing, or the server did not become ready
                within ``timeout`` seconds (its log is in the message).
        """
        missing = [t for t in ("ip", "unshare", "nsenter") if shutil.which(t) is None]
        if os.geteuid() != 0 or missing:
            raise FakenetError(f"the fake internet needs root and ip/unshare/nsenter (missing: {missing})")
        _fakenet_files.make_pki(self.workdir, list(ZONE), [WWW, API, PYPI, OTHER])
        _fakenet_files.make_index(self.index)
        config = {
            "addresses": ADDRESSES,
            "zone": ZONE,
            "dns": DNS,
            "cert": str(self.workdir / "server.pem"),
            "key": str(self.workdir / "server-key.pem"),
            "index": str(self.index),
        }
        with open(self.workdir / "zeros", "wb") as zeros:  # the byte source's (sparse) file
            zeros.truncate(8 << 20)
        config["zeros"] = str(self.workdir / "zeros")
        (self.workdir / "config.json").write_text(json.dumps(config))
        log = open(self.workdir / "server.log", "wb")  # noqa: SIM115 - owned by the process
        self._proc = subprocess.Popen(
            ["unshare", "--net", "--", sys.executable, "-m", "hermes_modal_tool.testing._fakenet_serve",
             str(self.workdir / "config.json")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
        )
        log.close()
        self.path = f"/proc/{self._proc.pid}/ns/net"
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        line = self._proc.stdout.readline() if ready else b""
        if line != b"ready\n":
            self.stop()
            text = (self.workdir / "server.log").read_text(errors="replace")[-2000:]
            raise FakenetError(f"the fake internet did not start in {timeout}s: {line!r}\n{text}")
        self.check_routes(self.path, allow_default=False)
        return self

    def attach(self, netns: str, *, default_route: bool = False, standins: bool = False,
               other_ifaces: str = "") -> str:
        """Connect the namespace at ``netns`` to the fake internet with a veth pair.

        Args:
            netns: a ``/proc/<pid>/ns/net`` path (or ``/proc/self/ns/net`` for ours).
            default_route: also route everything else to the fake internet (which drops
                it): what ``pasta`` needs to pick its interface. Refused for our own
                namespace.
            standins: also route the private and metadata stand-in addresses. Refused
                for our own namespace (the host may route those ranges for real).
            other_ifaces: a prefix of interface names the namespace may hold besides
                ``lo`` and the new one (a sandbox's router: its slots' ``hs<N>``).

        Returns:
            The namespace's address on the fake internet (``203.0.113.1xx``).
        """
        own = os.stat(netns).st_ino == os.stat("/proc/self/ns/net").st_ino
        if own and (default_route or standins):
            raise FakenetError("the test process's own namespace gets the public ranges only")
        self._next += 1
        address, ours, theirs = f"203.0.113.{self._next}", f"fnh{self._next}", f"fnc{self._next}"
        peer = "netns", str(os.getpid()) if own else netns
        # MTU 65520 (as slirp4netns and pasta use towards their namespace): the fake
        # internet's own link should not be what a benchmark of egress paths measures.
        _run("ip", "link", "add", "name", ours, "mtu", "65520", "type", "veth", "peer", "name", theirs,
             "mtu", "65520", *peer, netns=self.path)
        self._links.append((self.path, ours))
        _run("ip", "addr", "add", f"{GATEWAY}/32", "dev", ours, netns=self.path)
        _run("ip", "link", "set", ours, "up", netns=self.path)
        _run("ip", "route", "add", f"{address}/32", "dev", ours, netns=self.path)
        _run("ip", "addr", "add", f"{address}/32", "dev", theirs, netns=netns)
        _run("ip", "link", "set", theirs, "up", netns=netns)
        _run("ip", "route", "add", f"{GATEWAY}/32", "dev", theirs, netns=netns)
        routes = list(PUBLIC_RANGES) + (list(STANDIN_RANGES) if standins else [])
        routes += ["default"] if default_route else []
        for dest in routes:
            _run("ip", "route", "add", dest, "via", GATEWAY, "dev", theirs, netns=netns)
        self.check_routes(netns, allow_default=default_route, only=None if own else theirs, dev=theirs,
                          other_ifaces=other_ifaces)
        wait_carrier(netns, theirs)
        return address

    def netns(self, *, default_route: bool = False, standins: bool = True) -> NetNs:
        """A fresh namespace attached to the fake internet (closed by :meth:`stop`)."""
        ns = NetNs()
        self._clients.append(ns)
        ns.address = self.attach(ns.path, default_route=default_route, standins=standins)
        ns.ifname = f"fnc{self._next}"
        return ns

    def check_routes(
        self, netns: str, *, allow_default: bool, only: str | None = "", dev: str | None = None,
        other_ifaces: str = "",
    ) -> None:
        """Raise :class:`FakenetError` if ``netns`` routes anywhere but the fake internet.

        Every IPv4 route of its main table must point into the fake internet's ranges
        (``default`` only with ``allow_default``, and then through the fake internet's
        gateway); with ``dev``, only the routes through that interface are checked (our
        own namespace keeps its real routes). With ``only`` set (an interface name), the namespace's only interfaces
        must be ``lo`` and that one; the fake internet's own (``only=""``) may hold
        only ``lo`` and its ends of veth pairs.
        """
        allowed = [ipaddress.ip_network(r) for r in PUBLIC_RANGES + STANDIN_RANGES]
        for route in json.loads(_run("ip", "-j", "-4", "route", "show", "table", "main", netns=netns) or "[]"):
            dst = route["dst"]
            if dev is not None and route.get("dev") != dev:
                continue
            if dst == "default":
                if not allow_default or route.get("gateway") != GATEWAY:
                    raise FakenetError(f"{netns} has a default route {route}")
                continue
            net = ipaddress.ip_network(dst, strict=False)
            if not any(net.subnet_of(a) for a in allowed):
                raise FakenetError(f"{netns} routes {dst}, outside the fake internet: {route}")
        if only is None:
            return
        links = json.loads(_run("ip", "-j", "link", "show", netns=netns))
        names = {link["ifname"] for link in links}
        want = {"lo", only} if only else {"lo"}
        extra = names - want if only else {n for n in names - want if not n.startswith("fnh")}
        extra = {n for n in extra if not (other_ifaces and n.startswith(other_ifaces))}
        if extra:
            raise FakenetError(f"{netns} has interfaces outside the fake internet: {sorted(extra)}")

    def stop(self) -> None:
        """End the clients' namespaces, remove links into ours, stop the server. Idempotent."""
        for ns in self._clients:
            ns.close()
        self._clients.clear()
        if self._proc is not None:
            for path, name in self._links:
                with contextlib.suppress(FakenetError):  # gone with its namespace already
                    if self._proc.poll() is None:
                        _run("ip", "link", "del", name, netns=path)
            self._links.clear()
            if self._proc.poll() is None and self._proc.stdin is not None:
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None


def fake_internet(workdir: Path) -> Iterator[FakeInternet]:
    """Pytest fixture body: a started :class:`FakeInternet`, stopped afterwards."""
    net = FakeInternet(workdir)
    try:
        yield net.start()
    finally:
        net.stop()


def connect(address: str, port: int, timeout: float = 3.0) -> socket.socket:
    """A TCP connection to ``(address, port)`` from the calling thread's namespace."""
    return socket.create_connection((address, port), timeout=timeout)
