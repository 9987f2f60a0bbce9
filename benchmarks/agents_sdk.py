"""OpenAI Agents SDK benchmark: the SDK's own Modal sandbox client vs ours, per command.

Both run over the package's local Modal control plane
(``hermes_modal_tool.testing.modal_server``, started here on its own thread; the real
``modal`` SDK talks gRPC to it and it counts every RPC by method, and every request
message on streaming RPCs). Measured in one run, for the same exec loop (``--commands``
sequential ``session.exec("echo hi")`` calls on one session, after a short warm-up):

- the SDK's ``ModalSandboxClient`` (``agents.extensions.sandbox.modal``): one Modal
  sandbox per session; each ``exec`` is a ``Sandbox.exec`` (a new process, its own RPCs);
- ours, ``SlotSandboxClient`` on a ``ModalToolBackend``: the session is a slot of a pooled
  Modal sandbox; each ``exec`` is one framed request on the agent's open stream.

Printed: RPCs per command (by method), stream messages per command, latency per command
(median / p90 / p99), and the session's create time. ``--json PATH`` also writes every
number as JSON.

Usage (the Agents SDK lives in ``.venv-agents``; see the README)::

    .venv-agents/bin/python benchmarks/agents_sdk.py                 # 200 commands each
    .venv-agents/bin/python benchmarks/agents_sdk.py --commands 50 --json /tmp/agents_sdk.json

The server and its sandboxes run on this machine (no network in the latencies); the RPC
counts are what the SDKs send, so Modal would serve the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from agents.extensions.sandbox.modal import (
    ModalImageSelector,
    ModalSandboxClient,
    ModalSandboxClientOptions,
)

from hermes_modal_tool import ModalSandboxConfig, ModalToolBackend
from hermes_modal_tool.adapters.openai_agents import SlotSandboxClient, SlotSandboxClientOptions
from hermes_modal_tool.testing.modal_server import LocalModalServer, serve_for_this_process

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared benchmark helpers
from _proc import quantile  # noqa: E402

perf = time.perf_counter
PROFILE = f"agsdk{os.getpid()}"
COMMAND = "echo hi"
IMAGE = "python:3.11"
WARMUP = 5


def summary_ms(xs: Sequence[float]) -> dict[str, float]:
    return {"n": len(xs), "median": quantile(xs, 0.5) * 1e3, "p90": quantile(xs, 0.9) * 1e3,
            "p99": quantile(xs, 0.99) * 1e3, "mean": sum(xs) / max(len(xs), 1) * 1e3}


async def exec_loop(server: LocalModalServer, session: Any, n: int) -> dict[str, Any]:
    """``n`` sequential ``exec(COMMAND)``: latency and what the server received, per command."""
    for _ in range(WARMUP):
        await session.exec(COMMAND)
    await asyncio.sleep(0.2)  # streams opened in the background reach the server first
    server.reset_counts()
    xs, wrong = [], 0
    for _ in range(n):
        t0 = perf()
        r = await session.exec(COMMAND)
        xs.append(perf() - t0)
        wrong += r.stdout != b"hi\n" or r.exit_code != 0
    rpcs, messages = dict(server.rpc_counts), dict(server.stream_messages)
    return {"latency_ms": summary_ms(xs), "wrong_outputs": wrong,
            "rpcs_per_command": sum(rpcs.values()) / n,
            "rpcs_by_method_per_command": {k: v / n for k, v in sorted(rpcs.items())},
            "stream_messages_per_command": sum(messages.values()) / n,
            "stream_messages_by_method_per_command": {k: v / n for k, v in sorted(messages.items())}}


async def sdk_modal(server: LocalModalServer, n: int) -> dict[str, Any]:
    client = ModalSandboxClient(image=ModalImageSelector.from_tag(IMAGE))
    t0 = perf()
    session = await client.create(options=ModalSandboxClientOptions(app_name=f"{PROFILE}-sdk"))
    try:
        async with session:
            created = perf() - t0
            out = await exec_loop(server, session, n)
    finally:
        await client.delete(session)
    return {"create_and_start_s": created, **out}


async def ours(server: LocalModalServer, n: int) -> dict[str, Any]:
    backend = ModalToolBackend(ModalSandboxConfig(name=PROFILE, image=IMAGE, slots_per_sandbox=8,
                                                  min_sandboxes=1, max_sandboxes=1))
    t0 = perf()
    await backend.start()
    started = perf() - t0
    client = SlotSandboxClient(backend)
    try:
        t0 = perf()
        session = await client.create(options=SlotSandboxClientOptions())
        async with session:
            created = perf() - t0
            out = await exec_loop(server, session, n)
        await client.delete(session)
    finally:
        await client.aclose()
        await backend.stop()
    return {"backend_start_s": started, "create_and_start_s": created, **out}


def run(n: int) -> dict[str, Any]:
    res: dict[str, Any] = {"command": COMMAND, "commands": n, "nproc": len(os.sched_getaffinity(0))}
    with serve_for_this_process() as server:
        async def both() -> None:
            res["sdk_modal_client"] = await sdk_modal(server, n)
            res["ours_slot_client"] = await ours(server, n)
        asyncio.run(both())
    return res


def render(res: dict[str, Any]) -> None:
    print(f"Agents SDK sandbox clients over the local Modal control plane: {res['commands']} x "
          f"exec({res['command']!r}) on one session")
    print(f"{'client':<34}{'RPCs/cmd':>9}{'stream msgs/cmd':>17}{'median':>10}{'p90':>10}{'p99':>10}"
          f"{'session start':>15}")
    for label, key in (("SDK ModalSandboxClient", "sdk_modal_client"),
                       ("ours: SlotSandboxClient (Modal)", "ours_slot_client")):
        r = res[key]
        lat = r["latency_ms"]
        print(f"{label:<34}{r['rpcs_per_command']:>9.2f}{r['stream_messages_per_command']:>17.2f}"
              f"{lat['median']:>8.2f}ms{lat['p90']:>8.2f}ms{lat['p99']:>8.2f}ms"
              f"{r['create_and_start_s']:>14.2f}s")
    for label, key in (("SDK", "sdk_modal_client"), ("ours", "ours_slot_client")):
        methods = res[key]["rpcs_by_method_per_command"]
        print(f"  {label} RPCs per command: " + (", ".join(f"{k} {v:g}" for k, v in methods.items()) or "none"))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commands", type=int, default=200, metavar="N", help="sequential commands per client")
    ap.add_argument("--json", metavar="PATH", help="also write every number as JSON")
    args = ap.parse_args(argv)
    res = run(args.commands)
    render(res)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    wrong = res["sdk_modal_client"]["wrong_outputs"] + res["ours_slot_client"]["wrong_outputs"]
    return 0 if wrong == 0 and res["ours_slot_client"]["rpcs_per_command"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
