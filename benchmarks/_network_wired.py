"""The wired egress path of ``benchmarks/network.py``: real slots of a ``network: egress``
profile (the agent's router namespace per sandbox, a namespace per slot, its nftables
policy and resolver in the router) against a ``network: host`` profile in the same run.

The router is attached to the fake internet (``upstream: none``, as the tests do), so
the slot reaches nothing else. Per round, in each profile:

- ``start_ms``: ``release(reset_workspace=True)`` of the slot, ``acquire`` and a first
  ``true``: what a trajectory's slot start costs, including (for egress) tearing down and
  making the slot's namespace, veth pair, table and resolver; ``first_ms``: that first
  ``true`` alone (the slot's shell starts there); ``second_ms``: the next ``true``;
  ``settled_ms``: a first ``true`` in a slot released in the background and taken again a
  second later (the agent pre-starts the next tenant's shell, namespace included);
- in the egress slot only: the client of ``network.py`` (median TCP connect + 1-byte echo,
  one bulk download, how fast a refused destination fails), run by the slot's own
  ``python3``; its peer is the ``host`` path of ``network.py`` (a process in a namespace
  attached to the fake internet directly), measured by the caller in the same run.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

from hermes_modal_tool import SandboxConfig, ToolBackend
from hermes_modal_tool.testing import fakenet as fn

EGRESS = {"allow": ["*.example.test"], "dns": fn.DNS, "upstream": "none"}
#: The policy admits an address once an allowed name resolved to it (per slot, per lease).
RESOLVE = "python3 -c \"import socket; socket.gethostbyname('www.example.test')\" && "
SIZES = {"slots_per_sandbox": 1, "min_sandboxes": 1, "max_sandboxes": 1, "memory": 2048}


async def _bash(backend: ToolBackend, slot: Any, command: str) -> str:
    [r] = await backend.execute_batch([(slot, "bash", {"command": command, "timeout": 120})])
    if not r.success:
        raise RuntimeError(f"{command[:80]!r} failed in the slot: {r.error} {r.output[-400:]}")
    return r.output


async def _restart(backend: ToolBackend, slot: Any) -> tuple[Any, dict[str, float]]:
    t = time.perf_counter()
    await backend.release(slot, reset_workspace=True)
    slot = await backend.acquire("bench")
    t1 = time.perf_counter()
    await _bash(backend, slot, "true")
    t2 = time.perf_counter()
    await _bash(backend, slot, "true")
    t3 = time.perf_counter()
    # Released in the background, as a trainer's slots are, and taken a second later: the
    # agent pre-starts the next tenant's shell (its namespace included) meanwhile.
    await backend.release(slot)
    await asyncio.sleep(1.0)
    slot = await backend.acquire("bench")
    t4 = time.perf_counter()
    await _bash(backend, slot, "true")
    return slot, {"start_ms": (t2 - t) * 1000, "first_ms": (t2 - t1) * 1000, "second_ms": (t3 - t2) * 1000,
                  "settled_ms": (time.perf_counter() - t4) * 1000}


async def wired(net: fn.FakeInternet, client: str, rounds: int, connects: int, mb: int) -> dict[str, Any]:
    """Medians over ``rounds``: ``start_ms`` for ``host`` and ``egress``, and the client's
    figures (``connect_us``, ``MBps``, ``refused_us``) in the egress slot."""
    runs: dict[str, list[dict[str, float]]] = {"slot-host": [], "slot-egress": []}
    async with ToolBackend(SandboxConfig(name="bench-host", network="host", **SIZES)) as host, \
            ToolBackend(SandboxConfig(name="bench-egress", network="egress", egress=EGRESS, **SIZES)) as egress:
        h = await host.acquire("bench")
        e = await egress.acquire("bench")
        [sb] = egress._pools[egress.default_profile]._sandboxes.values()
        net.attach(str(sb.info["network_router"]), default_route=True, standins=True, other_ifaces="hs")
        await _bash(host, h, "true")
        await _bash(egress, e, f"cat > client.py <<'EOF'\n{client}\nEOF")
        await _bash(egress, e, f"{RESOLVE}python3 client.py 20 {1 << 20}")  # warm-up
        for _ in range(rounds):  # interleaved, so drift on a shared machine hits both
            h, h_ms = await _restart(host, h)
            e, e_ms = await _restart(egress, e)
            await _bash(egress, e, f"cat > client.py <<'EOF'\n{client}\nEOF")
            out = await _bash(egress, e, f"{RESOLVE}python3 client.py {connects} {mb << 20} {fn.OTHER}")
            runs["slot-host"].append(h_ms)
            runs["slot-egress"].append({**e_ms, **json.loads(out.strip().splitlines()[-1])})
    return {name: {key: statistics.median(r[key] for r in rs) for key in rs[0] if rs[0][key] is not None}
            for name, rs in runs.items()}


def run(net: fn.FakeInternet, client: str, rounds: int, connects: int, mb: int) -> dict[str, Any]:
    """:func:`wired`, from synchronous code."""
    return asyncio.run(wired(net, client, rounds, connects, mb))
