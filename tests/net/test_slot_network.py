"""``network: egress`` on the local driver, end to end: real sandboxes (bubblewrap,
the agent's router namespace, a namespace per slot) against the fake internet.

The profile says ``upstream: none``: the test attaches the sandbox's router namespace
to the fake internet itself (``FakeInternet.attach``), so nothing but the fake
internet is reachable and nothing is configured in the host's namespace. Verdicts are
read from the slot's side (what connected, how fast it failed) and from the host's
(the router's tables and interfaces, the namespaces that still exist).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
from typing import Any

import pytest
from support import SMALL, bash, settle

from hermes_modal_tool import SandboxConfig
from hermes_modal_tool.testing import fakenet as fn
from hermes_modal_tool.testing._fakenet_files import DEMO_MESSAGE, DEMO_PROJECT

EGRESS = {"allow": ["*.example.test"], "dns": fn.DNS, "upstream": "none"}

#: Run in a slot: each argument is ``resolve:NAME`` or ``connect:HOST:PORT``; prints
#: one JSON list of verdicts ("ok ..." or the error's name and the seconds it took).
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


def router_of(backend: Any) -> str:
    [sb] = [s for s in backend._pools[backend.default_profile]._sandboxes.values() if not s.dead]
    return str(sb.info["network_router"])


def in_router(router: str, *argv: str) -> str:
    """Run ``argv`` in the router namespace (read-only listings only)."""
    return subprocess.run(["nsenter", f"--net={router}", "--", *argv], capture_output=True,
                          text=True, check=True, timeout=20).stdout


def in_host(*argv: str) -> str:
    """Run ``argv`` in the host's namespace (read-only listings only)."""
    return subprocess.run(list(argv), capture_output=True, text=True, check=True, timeout=20).stdout


async def probe(backend: Any, slot: Any, *args: str) -> list[str]:
    await backend.execute_batch([(slot, "write_file", {"path": "probe.py", "content": PROBE})])
    r = await bash(backend, slot, "python3 probe.py " + " ".join(args))
    assert r.success, r.output
    return list(json.loads(r.output))


def refused_fast(verdict: str) -> bool:
    word, seconds = verdict.split()
    return word == "ConnectionRefusedError" and float(seconds) < 0.5


@pytest.fixture
async def egress(make_backend: Any, fakenet: fn.FakeInternet) -> Any:
    """A backend with one sandbox of two ``network: egress`` slots, its router on the
    fake internet; yields ``(backend, router path)``."""
    config = SandboxConfig(name="egress", **{**SMALL, "max_sandboxes": 1}, network="egress",
                           egress=EGRESS)
    backend = await make_backend(config=config)
    slot = await backend.acquire("egress-first")  # the sandbox is up: attach its router
    router = router_of(backend)
    fakenet.attach(router, default_route=True, standins=True, other_ifaces="hs")
    assert (await bash(backend, slot, "true")).success  # its shell, so its namespace, is up
    yield backend, router, slot


async def test_egress_allows_listed_names_and_refuses_the_rest(egress: Any) -> None:
    backend, router, slot = egress
    host = host_address()
    listener = socket.create_server(("0.0.0.0", 0))  # a service on all the host's addresses
    port = listener.getsockname()[1]
    try:
        # Positive controls, from the router (the fake internet's side): all answer.
        for address in (fn.WWW, fn.OTHER, fn.PRIVATE, fn.METADATA):
            in_router(router, "python3", "-c", f"import socket; socket.create_connection(('{address}', 7), 3)")
        with socket.create_connection((host, port), 3):  # and the host's service, from the host
            pass
        verdicts = await probe(
            backend, slot, "resolve:www.example.test", f"connect:{fn.WWW}:7",
            "resolve:other.test", f"connect:{fn.OTHER}:7", f"connect:{fn.PRIVATE}:7",
            f"connect:{fn.METADATA}:7", f"connect:{host}:{port}", f"connect:127.0.0.1:{port}")
    finally:
        listener.close()
    assert verdicts[0] == f"ok {fn.WWW}" and verdicts[1] == "ok hi", verdicts
    assert verdicts[2].startswith("gaierror"), verdicts  # NXDOMAIN from the agent's resolver
    for v in verdicts[3:7]:  # a raw IP, private, metadata, the host's own address
        assert refused_fast(v), verdicts
    assert verdicts[7].split()[0] == "ConnectionRefusedError", verdicts  # its own loopback only
    status = backend.get_status()
    assert status["pools"]["egress"]["network"] == "egress" and status["network_refused"] == 0
    await backend.release(slot)  # the tenant's refusals are counted as its slot is released
    assert await settle(lambda: backend.get_status()["network_refused"] >= 5, 10), backend.get_status()


async def test_slot_root_cannot_change_the_policy(egress: Any) -> None:
    backend, router, slot = egress
    table = ["nft", "-s", "list", "table", "inet", f"hmt_slot_{slot.index}"]
    before = in_router(router, *table)
    assert "learned4" in before
    r = await bash(backend, slot, (
        "id -u; unshare --net sh -c 'ip link set lo up && ip addr add 192.0.2.1/32 dev lo && ip route add 198.18.0.0/15 dev lo && echo own-namespace-ok'; "
        "ip route del default 2>&1; ip addr flush dev eth0 2>&1; nft flush ruleset 2>&1; "
        f"echo nameserver {fn.DNS} > /etc/resolv.conf && echo resolv-written; "
        "ip route show default"))
    lines = r.output.splitlines()
    assert lines[0] == "0" and "own-namespace-ok" in lines, r.output  # root, with power in its own
    assert sum("Operation not permitted" in line for line in lines) >= 3, r.output
    assert "resolv-written" in lines and lines[-1].startswith("default via 10.254."), r.output
    verdicts = await probe(backend, slot, "resolve:other.test", f"connect:{fn.OTHER}:7",
                           "resolve:api.example.test")
    assert verdicts[0].startswith("gaierror") and refused_fast(verdicts[1]), verdicts
    assert verdicts[2] == f"ok {fn.API}", verdicts
    after = in_router(router, *table)
    assert f"elements = {{ {fn.API} timeout" in after  # what the allowed name added, and no more:
    assert unlearned(after) == unlearned(before)
    # Raw and packet sockets (to forge packets past the resolver) need CAP_NET_RAW over the
    # namespace, which belongs to the agent's user namespace: refused; in a namespace of its
    # own making the same root gets them (the control).
    raw = ("import socket\nfor f, t, p in ((socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP), "
           "(socket.AF_PACKET, socket.SOCK_RAW, 0)):\n    try:\n        socket.socket(f, t, p).close(); print('opened')\n"
           "    except PermissionError:\n        print('refused')\n")
    await backend.execute_batch([(slot, "write_file", {"path": "raw.py", "content": raw})])
    r = await bash(backend, slot, "python3 raw.py; unshare --net python3 raw.py")
    assert r.output.split() == ["refused", "refused", "opened", "opened"], r.output


async def test_pip_installs_from_an_allowed_index_through_the_egress_path(
        egress: Any, fakenet: fn.FakeInternet) -> None:
    """pip in the slot, by name through the agent's resolver and HTTPS with the fake
    internet's CA, from the PEP 503 index on an allowed name; before the name resolved,
    the index's address is refused (only what allowed names resolve to is reachable)."""
    backend, _, slot = egress
    [verdict] = await probe(backend, slot, f"connect:{fn.PYPI}:443")
    assert refused_fast(verdict), verdict
    await backend.execute_batch([(slot, "write_file", {"path": "ca.pem",
                                                       "content": fakenet.ca.read_text()})])
    r = await bash(backend, slot, (
        "PIP_CONFIG_FILE=/dev/null /usr/bin/python3 -m pip install -q --cert ca.pem "
        "--no-cache-dir --disable-pip-version-check --break-system-packages --retries 0 "
        "--timeout 10 --target site --index-url https://pypi.example.test/simple/ "
        f"{DEMO_PROJECT} 2>&1; echo rc=$?"), timeout=180)
    assert r.output.strip().endswith("rc=0"), r.output
    r = await bash(backend, slot, "PYTHONPATH=site /usr/bin/python3 -c "
                                  "'import hmt_fakenet_demo as m; print(m.MESSAGE)'")
    assert r.output.strip() == DEMO_MESSAGE, r.output


def unlearned(ruleset: str) -> list[str]:
    """``ruleset`` without the learned sets' elements (what allowed names resolved to)."""
    return [line for line in ruleset.splitlines() if " timeout " not in line]


async def test_two_slots_cannot_reach_each_other(egress: Any) -> None:
    backend, _, a = egress
    b = await backend.acquire("egress-second")
    serve = ("python3 -c \"import socket,os; s=socket.create_server(('0.0.0.0', 7007)); "
             "os.write(1, b'up'); c,_=s.accept(); c.sendall(c.recv(2))\" > /dev/null 2>&1 &"
             " sleep 0.3; ip -4 -o addr show dev eth0 | awk '{print $4}'")
    r = await bash(backend, a, serve)
    a_address = r.output.strip().split("/")[0]
    assert a_address.startswith("10.254."), r.output
    assert await probe(backend, a, f"connect:{a_address}:7007") == ["ok hi"]  # control
    await bash(backend, a, serve)
    [verdict] = await probe(backend, b, f"connect:{a_address}:7007")
    assert refused_fast(verdict), verdict


async def test_release_removes_the_slots_network(egress: Any, fakenet: fn.FakeInternet) -> None:
    backend, router, slot = egress
    await probe(backend, slot, "resolve:www.example.test")
    tables = in_router(router, "nft", "list", "tables")
    links = in_router(router, "ip", "-o", "link", "show")
    slot_ns = await bash(backend, slot, "readlink /proc/self/ns/net")
    inode = slot_ns.output.strip()
    assert inode.startswith("net:[") and inode in netns_in_use(), slot_ns.output
    assert "hmt_slot_" in tables and " hs" in links
    # Made in-process (libnftables, rtnetlink) from the agent's threads: in the router's
    # namespace, none of it in the host's (read-only listings of the host's).
    host_tables, host_links = in_host("nft", "list", "tables"), in_host("ip", "-o", "link", "show")
    assert "hmt_slot_" not in host_tables and " hs" not in host_links, (host_tables, host_links)
    learned = in_router(router, "nft", "list", "ruleset")
    assert fn.WWW in learned  # www's address is in the slot's learned set
    await backend.release(slot)
    # The next tenant of that slot gets a new namespace and an empty learned set.
    assert await settle(lambda: inode not in netns_in_use(), 10)
    assert fn.WWW not in in_router(router, "nft", "list", "ruleset")
    router_ns = f"net:[{os.stat(router).st_ino}]"
    assert router_ns in netns_in_use()  # the control: the router is there until the sandbox stops
    await backend.stop()
    assert await settle(lambda: router_ns not in netns_in_use(), 10)


@pytest.mark.parametrize("mode", ["none", "host"])
async def test_none_and_host_modes(make_backend: Any, mode: str) -> None:
    backend = await make_backend(config=SandboxConfig(name="m" + mode, **SMALL, network=mode))
    slot = await backend.acquire("mode")
    r = await bash(backend, slot, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
    if mode == "none":
        assert r.output.split() == ["lo"]
    else:
        with open("/proc/net/dev") as fh:  # noqa: ASYNC230 - a small /proc file
            host_ifaces = sorted(line.split(":")[0].strip() for line in fh.read().splitlines()[2:])
        assert sorted(r.output.split()) == host_ifaces
        assert os.readlink("/proc/self/ns/net") in (await bash(backend, slot, "readlink /proc/self/ns/net")).output


def host_address() -> str:
    """One of the host's own non-loopback IPv4 addresses."""
    from hermes_modal_tool.agent.net.hostaddrs import host_addresses

    found = [a for a in host_addresses() if "." in a and not a.startswith("127.")]
    if not found:
        pytest.skip("the host has no non-loopback IPv4 address")
    return found[0]


def netns_in_use() -> set[str]:
    """``net:[inode]`` of every network namespace a process is in or holds a descriptor of."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for link in [f"/proc/{pid}/ns/net"] + [f"/proc/{pid}/fd/{fd}" for fd in _fds(pid)]:
            try:
                target = os.readlink(link)
            except OSError:
                continue
            if target.startswith("net:["):
                found.add(target)
    return found


def _fds(pid: str) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []


async def test_slirp4netns_upstream(make_backend: Any) -> None:
    """The default upstream: the router reaches the host's network through slirp4netns
    (no rule in the host's namespace). A CIDR in ``allow`` opens one of the host's own
    addresses (refused by default); slirp4netns's alias of the host's loopback is not
    mapped; slirp4netns ends with the sandbox."""
    host = host_address()
    listener = socket.create_server(("0.0.0.0", 0))
    port = listener.getsockname()[1]

    def echo_once() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                conn.sendall(conn.recv(2))

    threading.Thread(target=echo_once, daemon=True).start()
    config = SandboxConfig(name="slirp", **{**SMALL, "max_sandboxes": 1}, network="egress",
                           egress={"allow": [f"{host}/32"], "dns": "127.0.0.1"})
    backend = await make_backend(config=config)
    try:
        slot = await backend.acquire("slirp")
        verdicts = await probe(backend, slot, f"connect:{host}:{port}", f"connect:10.0.2.2:{port}")
        router = router_of(backend)
        assert "default via 10.0.2.2 dev tap0" in in_router(router, "ip", "route")
        slirp = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).split(" ")[0].endswith("slirp4netns")
                 and f"/proc/self/fd/{router.rsplit('/', 1)[1]}" in _cmdline(p)]
    finally:
        listener.close()
    assert verdicts[0] == "ok hi", verdicts  # through slirp4netns to the host's address
    assert refused_fast(verdicts[1]), verdicts
    assert slirp, "no slirp4netns for the router"
    await backend.stop()
    assert await settle(lambda: not any(os.path.exists(f"/proc/{p}") and _cmdline(p) for p in slirp), 10)


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
