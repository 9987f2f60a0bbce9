"""Egress options for a slot's own network namespace, against the host network (issue 37).

A process in a fresh network namespace reaches the fake internet
(:mod:`hermes_modal_tool.testing.fakenet`) through each candidate path, and a process in
the *agent's* namespace (standing in for the host's: a namespace attached to the fake
internet with a default route, so nothing here reaches a real address) does the same in
the same run. Candidates:

- ``veth-nat``: a veth pair from the slot's namespace into the agent's, the agent's
  namespace forwarding with an nftables masquerade (one ``ip -batch`` per side);
- ``slirp4netns``: the slot's namespace gets a tap served by slirp4netns (user-mode TCP/IP
  in the agent's namespace), ``--ready-fd`` for readiness;
- ``veth-policy``: the same with the nftables filter a slot's policy compiles to (a set
  of allowed addresses, everything else rejected with a TCP reset); ``refused_us`` is
  how long a refused ``connect`` takes to fail;
- ``pasta``: passt's ``pasta --config-net -- CMD`` makes the namespace and runs the
  command in it (Debian bookworm's 2023-03 build attaches to no existing namespace here:
  as root it drops to ``nobody`` first and cannot open one; and ``/dev/net/tun`` is
  0600 on this VM, so neither tool runs unprivileged here).

Figures per path (each the median of ``--rounds`` runs):

- ``connect_us``: one TCP connect, a 1-byte echo and close, to the echo service (median
  of ``--connects`` in a row, in one process);
- ``MBps``: one connection downloading ``--mb`` MiB from the byte source;
- ``setup_ms``: making the slot's namespace and wiring its egress (here with ``unshare``,
  ``ip -batch`` and ``nft`` processes; the agent does it in-process, with rtnetlink and
  libnftables, once per slot, not per command: see the wired path's ``start_ms``); pasta's is inside its ``first_ms``, as it makes the
  namespace when it starts the command;
- ``first_ms``: a finished ``curl`` of the fake web server in a new process in the
  ready namespace; ``1st +ms`` is the difference to the host's: what a first command
  pays.

Then the wired path (:mod:`_network_wired`, skipped with ``--no-wired``): real slots of a
``network: egress`` profile against the ``host`` path's figures and a ``network: host``
slot's start, in the same run.

Needs root, ``slirp4netns`` and ``passt`` (Debian packages; scripts/setup.sh installs
them). Usage::

    .venv/bin/python benchmarks/network.py [--rounds 5] [--connects 300] [--mb 256] [--no-wired] [--json F]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hermes_modal_tool.testing import fakenet as fn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _network_wired  # noqa: E402

CLIENT = r"""
import json, socket, sys, time
n, size = int(sys.argv[1]), int(sys.argv[2])
lat = []
for _ in range(n):
    t = time.perf_counter()
    s = socket.create_connection(("WWW", 7), timeout=5)
    s.sendall(b"x"); s.recv(1); s.close()
    lat.append(time.perf_counter() - t)
lat.sort()
s = socket.create_connection(("WWW", 19), timeout=5)
t = time.perf_counter()
s.sendall(str(size).encode() + b"\n")
buf = bytearray(1 << 20); got = 0
while True:
    k = s.recv_into(buf)
    if not k: break
    got += k
secs = time.perf_counter() - t
assert got == size, got
refused_us = None
if sys.argv[3:]:  # a destination the policy refuses: how fast does connect fail?
    t = time.perf_counter()
    try:
        socket.create_connection((sys.argv[3], 7), timeout=5).close()
        raise SystemExit("connected to " + sys.argv[3] + ": not refused")
    except ConnectionRefusedError:
        refused_us = (time.perf_counter() - t) * 1e6
print(json.dumps({"connect_us": lat[len(lat) // 2] * 1e6, "MBps": size / secs / 1e6,
                  "refused_us": refused_us}))
""".replace("WWW", fn.WWW)
CURL = ["curl", "-sS", "-o", "/dev/null", "--max-time", "5", f"http://{fn.WWW}/"]
QUIET = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
POLICED = "hmtp0"  # the veth-policy path's interface: filtered by nftables in the agent's namespace
SLOT_NET = "10.200.0"  # the veth path's slot side (/30 per slot; one slot at a time here)


def _check(cmd: list[str], **kw: Any) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr[-800:]}")
    return proc.stdout


class Paths:
    """Ways to start a process with egress, each a context manager yielding a prefix."""

    def __init__(self, agent: fn.NetNs) -> None:
        self.agent = agent
        self.enter_agent = ["nsenter", f"--net={agent.path}", "--"]

    @contextlib.contextmanager
    def host(self) -> Iterator[list[str]]:
        yield self.enter_agent

    def veth_nat(self) -> contextlib.AbstractContextManager[list[str]]:
        return self._veth("hmtv0")

    def veth_policy(self) -> contextlib.AbstractContextManager[list[str]]:
        return self._veth(POLICED)

    @contextlib.contextmanager
    def _veth(self, name: str) -> Iterator[list[str]]:
        slot = subprocess.Popen(["unshare", "--net", "--", "cat"], stdin=subprocess.PIPE, **QUIET)
        try:
            fn.wait_unshared(slot.pid)  # else the veth's end would land in this namespace
            _check([*self.enter_agent, "ip", "-batch", "-"], input=(
                f"link add name {name} mtu 65520 type veth peer name eth0 mtu 65520 netns {slot.pid}\n"
                f"addr add {SLOT_NET}.1/30 dev {name}\nlink set {name} up\n"))
            _check(["nsenter", f"--net=/proc/{slot.pid}/ns/net", "--", "ip", "-batch", "-"], input=(
                f"link set lo up\naddr add {SLOT_NET}.2/30 dev eth0\nlink set eth0 up\n"
                f"route add default via {SLOT_NET}.1\n"))
            fn.wait_carrier(f"/proc/{slot.pid}/ns/net", "eth0")
            yield ["nsenter", f"--net=/proc/{slot.pid}/ns/net", "--"]
        finally:
            slot.kill()
            slot.wait()  # the veth pair goes with the slot's namespace

    @contextlib.contextmanager
    def slirp4netns(self) -> Iterator[list[str]]:
        slot = subprocess.Popen(["unshare", "--net", "--", "cat"], stdin=subprocess.PIPE, **QUIET)
        fn.wait_unshared(slot.pid)
        ready_r, ready_w = os.pipe()
        slirp = subprocess.Popen(
            [*self.enter_agent, "slirp4netns", "--configure", "--mtu=65520", "--disable-host-loopback",
             "--ready-fd", str(ready_w), str(slot.pid), "tap0"], pass_fds=[ready_w], **QUIET)
        os.close(ready_w)
        try:
            if os.read(ready_r, 1) != b"1":
                raise RuntimeError("slirp4netns did not become ready")
            yield ["nsenter", f"--net=/proc/{slot.pid}/ns/net", "--"]
        finally:
            os.close(ready_r)
            for proc in (slirp, slot):
                proc.kill()
                proc.wait()

    @contextlib.contextmanager
    def pasta(self) -> Iterator[list[str]]:
        yield [*self.enter_agent, "pasta", "-f", "-q", "--runas", "0:0", "--config-net", "-4",
               "-t", "none", "-u", "none", "-T", "none", "-U", "none", "--"]


def nat_in_agent(agent: fn.NetNs) -> None:
    """Forwarding and a masquerade for the veth path, in the agent's namespace only."""
    _check([*Paths(agent).enter_agent, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
    _check([*Paths(agent).enter_agent, "nft", "-f", "-"], input=(
        "table ip hmt_bench {\n chain post {\n  type nat hook postrouting priority 100;\n"
        f'  oifname "{agent.ifname}" masquerade\n }}\n}}\n'
        # What a slot's policy compiles to: a set of allowed addresses (the resolver adds
        # what allowed names resolve to), everything else refused at once and counted.
        "table inet hmt_bench_filter {\n"
        f" set allow4 {{\n  type ipv4_addr\n  flags interval\n  elements = {{ {fn.WWW} }}\n }}\n"
        " chain slots {\n  type filter hook forward priority 0; policy accept;\n"
        f'  iifname "{POLICED}" ct state established,related accept\n'
        f'  iifname "{POLICED}" ip daddr @allow4 counter accept\n'
        f'  iifname "{POLICED}" meta l4proto tcp counter reject with tcp reset\n'
        f'  iifname "{POLICED}" counter reject with icmpx admin-prohibited\n'
        " }\n}\n"))


def one_round(path: Callable[[], contextlib.AbstractContextManager[list[str]]],
              args: argparse.Namespace) -> dict[str, float]:
    t0 = time.perf_counter()
    with path() as prefix:
        t1 = time.perf_counter()
        _check([*prefix, *CURL])
        t2 = time.perf_counter()
        refuse = [fn.OTHER] if path.__name__ == "veth_policy" else []
        out = _check([*prefix, sys.executable, "-c", CLIENT, str(args.connects), str(args.mb << 20),
                      *refuse])
    figures = json.loads(out.strip().splitlines()[-1])
    return {**figures, "setup_ms": (t1 - t0) * 1000, "first_ms": (t2 - t1) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--connects", type=int, default=300)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--only", nargs="*", default=["veth-nat", "veth-policy", "slirp4netns", "pasta"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-wired", dest="wired", action="store_false",
                        help="skip the wired path (real slots of a network: egress profile)")
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    wired: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="hmt-netbench-") as tmp:
        net = fn.FakeInternet(Path(tmp)).start()
        try:
            agent = net.netns(default_route=True, standins=False)
            nat_in_agent(agent)
            paths = Paths(agent)
            table = {"host": paths.host, "veth-nat": paths.veth_nat, "veth-policy": paths.veth_policy,
                     "slirp4netns": paths.slirp4netns, "pasta": paths.pasta}
            names = ["host", *args.only]
            one_round(paths.host, args)  # warm-up: page cache, the server's threads
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
            for _ in range(args.rounds):  # interleaved, so drift on a shared machine hits all
                for name in names:
                    runs[name].append(one_round(table[name], args))
            results = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]
                              if rs[0][key] is not None} for name, rs in runs.items()}
            if args.wired:
                wired = _network_wired.run(net, CLIENT, args.rounds, args.connects, args.mb)
        finally:
            net.stop()
    host = results["host"]
    print(f"{'path':<12} {'connect us':>10} {'x host':>7} {'MB/s':>8} {'x host':>7} "
          f"{'setup ms':>9} {'first ms':>9} {'1st +ms':>8} {'refused us':>10}")
    for name, r in results.items():
        r["connect_ratio"] = r["connect_us"] / host["connect_us"]
        r["MBps_ratio"] = r["MBps"] / host["MBps"]
        r["first_added_ms"] = r["first_ms"] - host["first_ms"]
        refused = f"{r['refused_us']:>10.0f}" if "refused_us" in r else f"{'':>10}"
        print(f"{name:<12} {r['connect_us']:>10.0f} {r['connect_ratio']:>7.2f} {r['MBps']:>8.0f} "
              f"{r['MBps_ratio']:>7.2f} {r['setup_ms']:>9.1f} {r['first_ms']:>9.1f} "
              f"{r['first_added_ms']:>8.1f} {refused}")
    print(f"(median of {args.rounds} rounds; {args.connects} connects and {args.mb} MiB per round; "
          f"{os.cpu_count()} CPUs)")
    if wired:
        slot, plain = wired["slot-egress"], wired["slot-host"]
        slot["connect_ratio"] = slot["connect_us"] / host["connect_us"]
        slot["MBps_ratio"] = slot["MBps"] / host["MBps"]
        slot["start_added_ms"] = slot["start_ms"] - plain["start_ms"]
        print("\nwired: a slot of a network: egress profile (router, namespace, policy, resolver) against "
              "the host path above and a network: host slot")
        slot["first_added_ms"] = slot["first_ms"] - plain["first_ms"]
        slot["second_added_ms"] = slot["second_ms"] - plain["second_ms"]
        slot["settled_added_ms"] = slot["settled_ms"] - plain["settled_ms"]
        print(f"{'slot':<8} {'connect us':>10} {'x host':>7} {'MB/s':>7} {'x host':>7} {'start ms':>9} "
              f"{'+ms':>7} {'1st ms':>7} {'+ms':>7} {'2nd ms':>7} {'+ms':>6} {'settled':>7} {'+ms':>6} {'refused us':>10}")
        print(f"{'host':<8} {'':>10} {'':>7} {'':>7} {'':>7} {plain['start_ms']:>9.1f} {'':>7} "
              f"{plain['first_ms']:>7.1f} {'':>7} {plain['second_ms']:>7.2f} {'':>6} {plain['settled_ms']:>7.2f}")
        print(f"{'egress':<8} {slot['connect_us']:>10.0f} {slot['connect_ratio']:>7.2f} {slot['MBps']:>7.0f} "
              f"{slot['MBps_ratio']:>7.2f} {slot['start_ms']:>9.1f} {slot['start_added_ms']:>7.1f} "
              f"{slot['first_ms']:>7.1f} {slot['first_added_ms']:>7.1f} {slot['second_ms']:>7.2f} "
              f"{slot['second_added_ms']:>6.2f} {slot['settled_ms']:>7.2f} {slot['settled_added_ms']:>6.2f} "
              f"{slot.get('refused_us', float('nan')):>10.0f}")
        print("(start: release with reset, acquire and a first `true`; 1st: that `true` alone (the shell "
              "starts); 2nd: the next `true`; settled: a first `true` 1 s after a background release; medians)")
        results.update(wired)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
