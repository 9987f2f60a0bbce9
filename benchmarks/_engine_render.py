"""What the engine benchmark prints: its figures with their targets and floors beside."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from _proc import quantile

TARGETS = {
    "latency_median_ms": 0.4,
    "speedup_vs_swerex": 100.0,
    "calls_per_s": 10_000.0,
    "acquire_release_p50_ms": 5.0,
    "sandbox_start_ms": 100.0,
    "mib_per_slot": 5.0,
}


def summary_ms(xs: Sequence[float]) -> dict[str, float]:
    """Seconds in, a dict of milliseconds out."""
    return {"n": len(xs), "median": quantile(xs, 0.5) * 1e3, "p90": quantile(xs, 0.9) * 1e3,
            "p99": quantile(xs, 0.99) * 1e3, "min": min(xs) * 1e3, "max": max(xs) * 1e3,
            "mean": sum(xs) / len(xs) * 1e3}


def fmt_ms(v: float) -> str:
    if v != v:
        return "n/a"
    if v < 1:
        return f"{v * 1000:.0f} µs"
    if v < 100:
        return f"{v:.2f} ms"
    return f"{v:.0f} ms"


def fmt_lat(s: dict[str, float]) -> str:
    return f"{fmt_ms(s['median'])} / {fmt_ms(s['p90'])} / {fmt_ms(s['p99'])}"


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def render(res: dict[str, Any], quick: bool) -> str:
    lines: list[str] = []
    add = lines.append
    m = res["machine"]
    add("=" * 108)
    add(f"hermes_modal_tool engine benchmark{' (--quick)' if quick else ''}")
    add(f"machine: nproc={m['nproc']} ({m['cpu']}), mem={m['mem_total_gib']} GiB, kernel {m['kernel']}, "
        f"python {m['python']}, euid={m['euid']}")
    add(f"bwrap: {m['bwrap']} ({m['bwrap_version']}); swe-rex {m['swe_rex']}; "
        f"isolation {res.get('facts', {}).get('isolation')}, limits {res.get('facts', {}).get('limits')}; "
        f"commit {m['commit']}")
    add("=" * 108)
    row = "{:<56} {:>28} {:>14} {:>7}".format
    if "latency" in res:
        lat = res["latency"]
        o, s, p = lat["ours"], lat.get("swerex"), lat["subprocess"]
        if s and "error" in s:
            add(f"   SWE-ReX failed: {s['error']}")
            s = None
        add("a. warm `echo hi` round trip, one slot — median / p90 / p99")
        add(row("", "value", "target", "status"))
        add(row(f"   ours (execute_batch, n={o['n']})", fmt_lat(o), "<= 0.4 ms",
                verdict(o["median"] <= TARGETS["latency_median_ms"])))
        add(f"      (agent-side part (agent + bash): {fmt_ms(o['agent_side_median_ms'])}; host + pipes: "
            f"{fmt_ms(o['median'] - o['agent_side_median_ms'])}; min {fmt_ms(o['min'])})")
        if s:
            add(row(f"   SWE-ReX LocalRuntime session (n={s['n']})", fmt_lat(s), "", ""))
            add(f"      (session create: {fmt_ms(s['session_create_ms'])})")
        add(row(f"   subprocess.run(bash -c) (n={p['n']})", fmt_lat(p), "", ""))
        if lat.get("raw_bash"):
            add(row(f"   floor: raw persistent bash over pipes (n={lat['raw_bash']['n']})",
                    fmt_lat(lat["raw_bash"]), "", ""))
        if s:
            sp = s["median"] / o["median"]
            add(row("   speedup ours vs SWE-ReX (median)", f"{sp:,.0f}x", ">= 100x",
                    verdict(sp >= TARGETS["speedup_vs_swerex"])))
        add(row("   speedup ours vs subprocess.run (median)", f"{p['median'] / o['median']:,.1f}x", "", ""))
        add("")
    if "throughput" in res:
        tp = res["throughput"]
        add("b. throughput — trivial commands (calls/s)")
        add(row("", "calls/s", "target", "status"))
        for t in tp["ours"]:
            tag = f"{t['sandboxes']}x{t['slots'] // t['sandboxes']}"
            runs = t.get("rounds_runs") or [t["rounds_calls_per_s"]]
            add(row(f"   ours, {t['calls'] // t['slots']} rounds x {t['slots']} slots ({tag})"
                    + (f", median of {len(runs)} runs" if len(runs) > 1 else ""),
                    f"{t['rounds_calls_per_s']:,.0f}", ">= 10,000",
                    verdict(t["rounds_calls_per_s"] >= TARGETS["calls_per_s"])))
            if len(runs) > 1:
                add("      (the runs, in order: " + ", ".join(f"{x:,.0f}" for x in runs) + " calls/s)")
            cpu = t["cpu_us_per_call"]
            add(f"      (one round of {t['slots']} calls: {fmt_ms(t['round_ms'])}; wrong outputs: {t['wrong_outputs']}; "
                f"CPU per call: " + ", ".join(f"{k} {v:.0f} µs" for k, v in sorted(cpu.items()) if v >= 0.5)
                + f", total {sum(cpu.values()):.0f} µs => CPU-bound ceiling on {res['machine']['nproc']} cores: "
                f"{res['machine']['nproc'] / max(sum(cpu.values()), 1e-9) * 1e6:,.0f} calls/s)")
            add(row(f"   ours, the same as one batch of {t['calls']} ({tag})", f"{t['big_batch_calls_per_s']:,.0f}",
                    ">= 10,000", verdict(t["big_batch_calls_per_s"] >= TARGETS["calls_per_s"])))
        for key, how in (("raw_bash", ""), ("raw_bash_cgroups", ", each in its own memory+pids+cpu cgroup")):
            rb = tp.get(key)
            if rb and "error" in rb:
                add(f"   floor: raw persistent bashes{how}: not measured ({rb['error']})")
            elif rb:
                rcpu = rb["cpu_us_per_call"]
                add(row(f"   floor: {rb['shells']} raw persistent bashes{how}, rounds", f"{rb['calls_per_s']:,.0f}", "", ""))
                add(f"      (CPU per call: bash {rcpu['bash']:.0f} µs, driver {rcpu['driver']:.0f} µs)")
        st = tp["subprocess_threads"]
        add(row(f"   subprocess.run, thread pool of {st['workers']} ({st['calls']})", f"{st['calls_per_s']:,.0f}", "", ""))
        sa = tp["subprocess_asyncio"]
        add(row(f"   asyncio subprocess, {sa['concurrency']} at a time ({sa['calls']})",
                f"{sa['calls_per_s']:,.0f}", "", ""))
        for key in ("swerex_threads", "swerex_gather"):
            if tp.get(key) and "error" in tp[key]:
                add(f"   SWE-ReX ({key}) failed: {tp.pop(key)['error']}")
        if tp.get("swerex_threads"):
            sw = tp["swerex_threads"]
            add(row(f"   SWE-ReX, {sw['sessions']} sessions in threads ({sw['calls']})",
                    f"{sw['calls_per_s']:,.0f}", "", ""))
            add(f"      ({sw['ok']}/{sw['calls']} outputs correct; creating {sw['sessions']} sessions took "
                f"{sw['create_all_s']:.2f} s{'; errors: ' + str(sw['errors'][:1]) if sw.get('errors') else ''})")
        if tp.get("swerex_gather"):
            sg = tp["swerex_gather"]
            add(row(f"   SWE-ReX, asyncio.gather over {sg['sessions']} sessions", f"{sg['calls_per_s']:,.1f}", "", ""))
            add("      (one event loop: BashSession.run blocks in pexpect, so gather runs serially)")
        best = max(max(t["rounds_calls_per_s"], t["big_batch_calls_per_s"]) for t in tp["ours"])
        if tp.get("swerex_threads"):
            add(row("   speedup ours (best) vs SWE-ReX threads", f"{best / tp['swerex_threads']['calls_per_s']:,.0f}x", "", ""))
        add(row("   speedup ours (best) vs subprocess threads", f"{best / st['calls_per_s']:,.1f}x", "", ""))
        add("")
    if "acquire_release" in res:
        ar = res["acquire_release"]
        add("c. acquire + release(reset_workspace=True) — p50 / p99")
        add(row("", "p50 / p99", "target", "status"))
        a = ar["acquire_release"]
        add(row(f"   acquire + release (n={a['n']})", f"{fmt_ms(a['median'])} / {fmt_ms(a['p99'])}",
                "p50 <= 5 ms", verdict(a["median"] <= TARGETS["acquire_release_p50_ms"])))
        c = ar["acquire_cmd_release"]
        add(row("   acquire + 1 command + release", f"{fmt_ms(c['median'])} / {fmt_ms(c['p99'])}",
                "(p50 <= 5 ms)", verdict(c["median"] <= TARGETS["acquire_release_p50_ms"])))
        add(f"      parts p50: acquire {fmt_ms(ar['part_acquire']['median'])}, first command "
            f"{fmt_ms(ar['part_first_cmd']['median'])} (its shell was started ahead), release+reset "
            f"{fmt_ms(ar['part_release_reset']['median'])}")
        add(f"      back to back: mean {fmt_ms(c['mean'])}, p90 {fmt_ms(c['p90'])} (first command p90 "
            f"{fmt_ms(ar['part_first_cmd']['p90'])}: a slot whose next shell is still starting; the "
            "mean is what the machine's CPU allows, see below)")
        cyc = ar.get("cpu_ms_per_cycle", {})
        if cyc:
            tot = sum(cyc.values())
            busy = ar["machine_busy_ms_per_cycle"]
            add("      back to back, CPU per cycle of live processes: " + ", ".join(
                f"{k} {v:.1f} ms" for k, v in sorted(cyc.items()) if v >= 0.05)
                + f", total {tot:.1f} ms; the whole machine's busy time per cycle {busy:.1f} ms (with the "
                f"shells killed at reset and other users) => at most "
                f"{res['machine']['nproc'] / max(busy, 1e-9) * 1e3:,.0f} cycles/s on {res['machine']['nproc']} "
                "cores: the slot's next shell and root layer are made in the background, and back to back "
                "that work falls behind")
        if "acquire_cmd_release_paced" in ar:
            cp = ar["acquire_cmd_release_paced"]
            pa = ar["paced_parts_ms"]
            add(row(f"   the same, one cycle every {ar['pace_s'] * 1e3:.0f} ms (n={cp['n']})",
                    f"{fmt_ms(cp['median'])} / {fmt_ms(cp['p99'])}", "p50 <= 5 ms",
                    verdict(cp["median"] <= TARGETS["acquire_release_p50_ms"])))
            add(f"      parts p50: acquire {fmt_ms(pa[0])}, first command {fmt_ms(pa[1])}, "
                f"release+reset {fmt_ms(pa[2])}")
        if "after_200mb" in ar:
            z = ar["after_200mb"]
            add(row(f"   release + acquire after 200 MB / 5,000 files (n={z['n']})",
                    f"{fmt_ms(z['median'])} / {fmt_ms(z['max'])}", "p50 <= 5 ms",
                    verdict(z["median"] <= TARGETS["acquire_release_p50_ms"])))
            add(f"      slot filesystem: {ar.get('filesystem')} (p50 / max); shells start "
                f"{ar.get('shell_start')}")
        add("")
    if "cold" in res:
        cs = res["cold"]
        add("d. cold start — median (min..max)")
        add(row("", "median", "target", "status"))
        bs = cs["backend_start"]
        add(row(f"   new backend: start() to ready (n={bs['n']})",
                f"{fmt_ms(bs['median'])} ({fmt_ms(bs['min'])}..{fmt_ms(bs['max'])})", "<= 100 ms",
                verdict(bs["median"] <= TARGETS["sandbox_start_ms"])))
        g = cs["growth_sandbox_start"]
        add(row(f"   extra sandbox by pool growth (acquire, n={g['n']})",
                f"{fmt_ms(g['median'])} ({fmt_ms(g['min'])}..{fmt_ms(g['max'])})", "<= 100 ms",
                verdict(g["median"] <= TARGETS["sandbox_start_ms"])))
        f = cs["first_cmd_fresh_slot"]
        add(row(f"   first command in a fresh slot (n={f['n']})", fmt_lat(f), "", ""))
        add(f"      (first command right after start(): {fmt_ms(cs['first_cmd_after_start']['median'])}; "
            f"the second command: {fmt_ms(cs['second_cmd']['median'])})")
        for label, v in cs.get("floors", {}).items():
            add(row(f"   floor: {label}"[:56], fmt_ms(v["median"]), "", ""))
        add("")
    if "memory" in res:
        mm = res["memory"]
        add(f"e. idle memory per live slot — {mm['slots']} slots in {mm['sandboxes']} sandboxes "
            f"x {mm['slots_per_sandbox']}")
        add(row("", "MiB / slot", "target", "status"))
        add(row("   MemAvailable delta / slots", f"{mm['memavailable_mib_per_slot']:.2f}", "<= 5 MiB",
                verdict(mm["memavailable_mib_per_slot"] <= TARGETS["mib_per_slot"])))
        add(row("   sum of PSS (agents+bwraps+bashes) / slots", f"{mm['pss_mib_per_slot']:.2f}", "<= 5 MiB",
                verdict(mm["pss_mib_per_slot"] <= TARGETS["mib_per_slot"])))
        add(f"      MemAvailable delta {mm['memavailable_delta_mib']:.0f} MiB (Slab +{mm['slab_delta_mib']:.0f}, "
            f"PageTables +{mm['pagetables_delta_mib']:.0f}, Shmem +{mm['shmem_delta_mib']:.0f}); "
            f"PSS total {mm['pss_total_mib']:.0f} MiB")
        for kind, v in sorted(mm["by_kind"].items()):
            add(f"      {kind:<11} x{v['count']:<5} PSS {v['pss_kib'] / 1024:7.1f} MiB "
                f"({v['pss_kib'] / max(v['count'], 1):6.0f} KiB each), RSS {v['rss_kib'] / 1024:7.1f} MiB")
        add(f"      live check: {mm['live_slots']}/{mm['slots']} slots answered `echo $HOSTNAME` correctly "
            f"in one batch ({mm['echo_all_s'] * 1e3:.0f} ms); {mm['spawn_failures']} spawn failures"
            + (f" e.g. {mm['spawn_failure_sample'][:1]}" if mm["spawn_failures"] else ""))
        add(f"      start {mm['sandboxes']} sandboxes: {mm['start_s'] * 1e3:.0f} ms; first `true` in all "
            f"{mm['slots']} slots (spawns every shell): {mm['spawn_all_s'] * 1e3:.0f} ms; "
            f"1 s after stop: Slab+PageTables {mm['after_stop_slab_pagetables_delta_mib']:+.0f} MiB vs before, "
            f"MemAvailable {mm['memavailable_not_returned_mib']:.0f} MiB short (the kernel frees namespace "
            f"memory lazily; back within ~20 s)")
        add(row("   all slots live", f"{mm['live_slots']}/{mm['slots']}", f"{mm['slots']}",
                verdict(mm["live_slots"] == mm["slots"])))
        add("")
    if "fresh" in res:
        fr = res["fresh"]
        fl = fr["floor"]
        add(f"f. shells per second — the first `true` in {fr['slots']} fresh slots ({fr['sandboxes']} sandboxes)")
        add(row("", "shells/s", "", ""))
        add(row(f"   ours: {fr['slots']} first commands in one batch", f"{fr['shells_per_s']:,.0f}", "", ""))
        add(f"      ({fr['wall_s']:.2f} s; {fr['failed']} failed)")
        add(row(f"   floor: bwrap ... true, {fl['parallel']} at a time (n={fl['n']})", f"{fl['per_s']:,.0f}", "", ""))
        add(f"      (ours / floor: {fr['shells_per_s'] / max(fl['per_s'], 1e-9):.2f}; floor failures: {fl['failed']})")
        if "cpu_ms_per_shell" in fr and "machine_cpu_ms_per_start" in fl:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(fr["cpu_ms_per_shell"].items(),
                                                                  key=lambda kv: -kv[1]))
            add(f"      machine CPU per shell {fr['machine_cpu_ms_per_shell']:.2f} ms ({parts}) against "
                f"{fl['machine_cpu_ms_per_start']:.2f} ms per `bwrap ... true` start")
        if "live_floor" in fr:
            lf = fr["live_floor"]
            add(row(f"   floor: the same shells' processes without the agent (n={lf['n']})",
                    f"{lf['per_s']:,.0f}", "", ""))
            add(f"      (bwrap with a slot's options on the host's root, bash answering a first line, "
                f"all kept running; {lf['parallel']} at a time; ours / it: "
                f"{fr['shells_per_s'] / max(lf['per_s'], 1e-9):.2f}; machine CPU "
                f"{lf['machine_cpu_ms_per_start']:.2f} ms per shell; failures: {lf['failed']})")
        if "after_s" in fr:
            add(f"      then, put off while the CPU was busy (standby layers): ours {fr['after_cpu_ms_per_shell']:.2f} ms, "
                f"machine {fr['after_machine_cpu_ms_per_shell']:.2f} ms CPU per slot, done {fr['after_s']:.1f} s "
                "after the batch")
        add("")
    if "streaming" in res:
        from streaming import render as render_streaming

        add("g. live output")
        for line in render_streaming(res["streaming"]):
            add("   " + line)
        add("")
    cl = res.get("cleanup", {})
    add(f"cleanup: {'CLEAN' if cl.get('clean') else 'LEFTOVERS'} — ours: live bwrap {cl.get('our_bwrap_live')}, "
        f"descendants {cl.get('our_descendants')}, state dirs {cl.get('our_state_dirs')}, "
        f"cgroups {cl.get('our_cgroups')}")
    if res.get("subreaper"):
        add(f"         orphans re-parented to this process (we are a child subreaper): {cl.get('orphans_reaped')} "
            f"zombies reaped (bwrap inits whose outer bwrap ended first: slots killed at reset/stop, the live floor's shells), live: {cl.get('orphans_live')}")
    live, zombie = cl.get("pgrep_bwrap_live") or [], cl.get("pgrep_bwrap_zombie") or []
    add(f"         `pgrep -f bwrap` machine-wide: {len(live)} live {live[:8]}{' ...' if len(live) > 8 else ''}, "
        f"{len(zombie)} zombie{' (other users of the machine: ours are re-parented to us and reaped)' if live or zombie else ''}")
    cpu = res.get("cpu_log", [])
    if cpu:
        add("CPU used by other processes during each step (a shared machine skews results):")
        add("   " + "; ".join(f"{c['step'].split()[0]}{c['step'].split()[1] if len(c['step'].split()) > 1 else ''} "
                              f"{c['other_cpu_low_s'] / c['wall_s']:.2f}..{c['other_cpu_s'] / c['wall_s']:.2f}"
                              for c in cpu) + "  (cores busy elsewhere, lower..upper bound)")
    add(f"total wall time: {res['wall_s']:.1f} s")
    add("=" * 108)
    return "\n".join(lines)
