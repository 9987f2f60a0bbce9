"""The throughput sections of ``run_all.py``: rounds of ``execute_batch`` against the number
of slots, beside the peers at the same concurrency (a thread pool of N for
``subprocess.run``, N SWE-ReX sessions in threads, N concurrent execs per command, ours on
the Modal driver), and against ``slots_per_sandbox`` (a fixed slot count packed into 1..N
sandboxes, with the memory of each layout); and the memory of idle SWE-ReX sessions, the
peer of an idle slot.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from _machine import log
from _peers import _swerex_imports, throughput_subprocess_threads, throughput_swerex_threads
from _proc import process_memory, pss_kib
from _rounds import echo_rounds, warm_up
from _run_all_setup import PROFILE, Sizes, backend, modal_server

from hermes_modal_tool import ModalSandboxConfig, SandboxConfig

perf = time.perf_counter


async def tp_ours(config: SandboxConfig, slots: int, sizes: Sizes, rounds: int | None = None,
                  memory: bool = False) -> dict[str, Any]:
    """Rounds of one ``execute_batch`` over ``slots`` slots (``echo i``), after 3 warm-up
    rounds (which start every slot's shell); optionally the PSS of every process."""
    rounds = rounds or max(sizes.tp_rounds, -(-sizes.tp_calls // slots))
    t0 = perf()
    async with backend(config) as b:
        ss = [await b.acquire(f"tp{i}") for i in range(slots)]
        start_s = perf() - t0
        await warm_up(b, ss)
        mem = await asyncio.to_thread(process_memory) if memory else None
        dt, wrong = await echo_rounds(b, ss, rounds)
        for s in ss:
            await b.release(s)
    out = {"slots": slots, "sandboxes": config.min_sandboxes,
           "slots_per_sandbox": config.slots_per_sandbox, "rounds": rounds,
           "calls": rounds * slots, "seconds": dt, "calls_per_s": rounds * slots / dt,
           "round_ms": dt / rounds * 1e3, "wrong_outputs": wrong, "start_and_acquire_s": start_s}
    if mem is not None:
        pss = sum(v["pss_kib"] for v in mem.values())
        out.update(pss_mib_per_slot=pss / 1024 / slots,
                   processes={k: v["count"] for k, v in mem.items()})
    return out


def tp_subprocess(workers: int, sizes: Sizes) -> dict[str, Any]:
    calls = max(workers * sizes.tp_rounds, sizes.tp_calls // 4)
    r = throughput_subprocess_threads(calls, workers)
    return {"slots": workers, **r}


async def tp_exec(sb: Any, concurrent: int, sizes: Sizes) -> dict[str, Any]:
    """Rounds of ``concurrent`` execs per command at once on one sandbox (the original's way)."""
    import modal_rpc

    rounds = max(sizes.tp_rounds, -(-sizes.tp_calls // 40 // concurrent))
    await asyncio.gather(*(modal_rpc.exec_once(sb, "true") for _ in range(concurrent)))
    wrong = 0
    t0 = perf()
    for i in range(rounds):
        rs = await asyncio.gather(*(modal_rpc.exec_once(sb, f"echo {i}")
                                    for _ in range(concurrent)))
        wrong += sum(out != f"{i}\n" for out, _, _ in rs)
    dt = perf() - t0
    return {"slots": concurrent, "rounds": rounds, "calls": rounds * concurrent, "seconds": dt,
            "calls_per_s": rounds * concurrent / dt, "wrong_outputs": wrong}


async def tp_modal(sizes: Sizes) -> dict[str, list[dict[str, Any]]]:
    import modal

    out: dict[str, list[dict[str, Any]]] = {"ours_modal": [], "exec_original": []}
    for n in sizes.modal_slots:
        sbx = -(-n // sizes.per_sandbox)
        config = ModalSandboxConfig(name=f"{PROFILE}mt",
                                    slots_per_sandbox=min(n, sizes.per_sandbox),
                                    min_sandboxes=sbx, max_sandboxes=sbx, scale_down_idle=False)
        out["ours_modal"].append(await tp_ours(config, n, sizes))
        log(f"   ours (Modal driver), {n} slots: {out['ours_modal'][-1]['calls_per_s']:,.0f}/s")
    app = await modal.App.lookup.aio(f"{PROFILE}-tp", create_if_missing=True)
    sb = await modal.Sandbox.create.aio(app=app, image=modal.Image.from_registry("python:3.11"))
    try:
        for n in sizes.exec_slots:
            out["exec_original"].append(await tp_exec(sb, n, sizes))
            log(f"   exec per command, {n} at once: "
                f"{out['exec_original'][-1]['calls_per_s']:,.0f}/s")
    finally:
        await sb.terminate.aio()
    return out


def throughput_vs_slots(sizes: Sizes) -> dict[str, Any]:
    res: dict[str, Any] = {"per_sandbox": sizes.per_sandbox, "command": "echo i",
                           "ours_local": [], "subprocess": [], "swerex": []}
    for n in sizes.slots:
        sbx = -(-n // sizes.per_sandbox)
        config = SandboxConfig(name=f"{PROFILE}t", slots_per_sandbox=min(n, sizes.per_sandbox),
                               min_sandboxes=sbx, max_sandboxes=sbx, scale_down_idle=False)
        res["ours_local"].append(asyncio.run(tp_ours(config, n, sizes)))
        log(f"   ours (local driver), {n} slots: {res['ours_local'][-1]['calls_per_s']:,.0f}/s")
        res["subprocess"].append(tp_subprocess(n, sizes))
        log(f"   subprocess.run, {n} threads: {res['subprocess'][-1]['calls_per_s']:,.0f}/s")
    for n in sizes.swerex_slots:
        cmds = max(sizes.tp_rounds, min(50, sizes.tp_calls // 80 // n))
        try:
            r = throughput_swerex_threads(n, cmds)
        except Exception as exc:  # noqa: BLE001 - SWE-ReX gives up on a slow prompt
            res.setdefault("swerex_failed", []).append(
                {"slots": n, "error": f"{type(exc).__name__}: {exc}"[:200]})
            log(f"   SWE-ReX, {n} sessions in threads: failed ({type(exc).__name__})")
            continue
        res["swerex"].append({"slots": n, **r})
        log(f"   SWE-ReX, {n} sessions in threads: {r['calls_per_s']:,.1f}/s "
            f"({r['ok']}/{r['calls']} correct)")
    with modal_server():
        res.update(asyncio.run(tp_modal(sizes)))
    return res


def throughput_vs_sps(sizes: Sizes) -> dict[str, Any]:
    res: dict[str, Any] = {"slots": sizes.sps_slots, "layouts": []}
    for sbx in sizes.sps_sandboxes:
        per = sizes.sps_slots // sbx
        config = SandboxConfig(name=f"{PROFILE}s", slots_per_sandbox=per, min_sandboxes=sbx,
                               max_sandboxes=sbx, scale_down_idle=False, execution_timeout_s=120)
        r = asyncio.run(tp_ours(config, per * sbx, sizes, rounds=sizes.sps_rounds, memory=True))
        res["layouts"].append(r)
        log(f"   {sbx} x {per}: {r['calls_per_s']:,.0f}/s, {r['pss_mib_per_slot']:.2f} MiB/slot")
    return res


async def swerex_memory(sessions: int) -> dict[str, Any]:
    """PSS of ``sessions`` idle SWE-ReX sessions: their shells, and this process's growth."""
    LocalRuntime, Create, _, _ = _swerex_imports()
    own0 = pss_kib(os.getpid())[0]
    before = await asyncio.to_thread(process_memory)
    rt = LocalRuntime()
    try:
        for i in range(sessions):  # each starts its bash (pexpect) and waits for the prompt
            await rt.create_session(Create(session=f"m{i}", startup_timeout=30.0))
        await asyncio.sleep(1.0)
        after = await asyncio.to_thread(process_memory)
        own1 = pss_kib(os.getpid())[0]
    finally:
        await rt.close()
    kids = sum(v["pss_kib"] for v in after.values()) - sum(v["pss_kib"] for v in before.values())
    return {"sessions": sessions, "children_pss_mib_per_session": kids / 1024 / sessions,
            "host_pss_growth_mib_per_session": (own1 - own0) / 1024 / sessions,
            "pss_mib_per_session": (kids + own1 - own0) / 1024 / sessions,
            "processes": {k: v["count"] - before.get(k, {}).get("count", 0)
                          for k, v in after.items()}}
