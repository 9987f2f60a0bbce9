"""The report of benchmarks/run_all.py: markdown, made from ``report.json`` only (the
plots are in :mod:`_report_plots`).

Nothing here measures: :func:`render_readme` reads the report dict that ``run_all.py``
wrote (or the committed ``benchmarks/results/report.json``), so the README can be rebuilt
from it at any time.
"""

from __future__ import annotations

import math
from typing import Any

from _proc import quantile

SCRIPTS = ("engine", "modal_rpc", "load")
#: system key -> (label, colour); the order of every table and plot.
SYSTEMS = {
    "ours_local": ("ours, local driver", "#1f77b4"),
    "ours_modal": ("ours, Modal driver", "#17becf"),
    "exec_original": ("exec per command (original backend)", "#d62728"),
    "langchain_modal": ("exec per command (langchain-modal)", "#ff7f0e"),
    "swerex": ("SWE-ReX session", "#2ca02c"),
    "subprocess": ("subprocess.run", "#7f7f7f"),
}
HIST_LO_S, HIST_PER_DECADE = 1e-5, 10  # histogram bins: 10 per decade from 10 µs


def dig(d: Any, path: str, default: Any = None) -> Any:
    """``d["a"]["b"]`` for ``"a.b"``; ``default`` when any step is missing (the scripts'
    JSON keys may change, so they are read defensively)."""
    for key in path.split("."):
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d


def memory_rows(rep: dict[str, Any]) -> list[tuple[str, float, str]]:
    """(label, MiB per slot, colour) of every memory-per-slot measurement in the report."""
    rows = []
    em = dig(rep, "engine.result.memory")
    if em:
        rows.append((f"ours: PSS, {em['slots']} slots", em["pss_mib_per_slot"],
                     SYSTEMS["ours_local"][1]))
        rows.append((f"ours: MemAvailable, {em['slots']} slots", em["memavailable_mib_per_slot"],
                     "#aec7e8"))
    sm = rep.get("peer_memory")
    if sm:
        rows.append((f"SWE-ReX: PSS, {sm['sessions']} sessions", sm["pss_mib_per_session"],
                     SYSTEMS["swerex"][1]))
    return rows


def rpc_rows(rep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """RPCs per command by system: modal_rpc.py's (ours, the original) and ours (langchain)."""
    rows = {}
    for key, src in (("ours_modal", "ours"), ("exec_original", "original")):
        d = dig(rep, f"modal_rpc.result.{src}.latency")
        if d and "rpcs_per_command" in d:
            rows[key] = {"rpcs": d["rpcs_per_command"], "n": d.get("n"), "source": "modal_rpc.py",
                         "stream_messages": d.get("stream_messages_per_command") or {}}
    d = dig(rep, "latency.systems.langchain_modal.per_command")
    if d:
        rows["langchain_modal"] = {**d, "source": "run_all.py"}
    return rows


# -- the report: markdown ---------------------------------------------------------------------
def fmt_ms(v: float | None) -> str:
    if v is None or v != v:
        return "n/a"
    if v < 1:
        return f"{v * 1000:.0f} µs"
    return f"{v:.2f} ms" if v < 10 else f"{v:.1f} ms" if v < 100 else f"{v:,.0f} ms"


def minutes(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def fmt_rate(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _at(points: list[dict[str, Any]] | None, n: int) -> dict[str, Any] | None:
    return next((p for p in points or [] if p["slots"] == n), None)


def _best(points: list[dict[str, Any]] | None) -> str:
    if not points:
        return ""
    p = max(points, key=lambda p: p["calls_per_s"])
    return f"{fmt_rate(p['calls_per_s'])} (N={p['slots']})"


def headline(rep: dict[str, Any]) -> list[list[str]]:
    """Rows of the headline table (the first row is the header); cells '' when not measured."""
    keys = list(SYSTEMS)
    rows = [["measurement", *(SYSTEMS[k][0] for k in keys)]]

    def row(label: str, cells: dict[str, str]) -> None:
        rows.append([label, *(cells.get(k, "") for k in keys)])

    lat = dig(rep, "latency.systems") or {}
    row("warm `echo hi` round trip, median (p99)",
        {k: f"{fmt_ms(v['ms']['p50'])} ({fmt_ms(v['ms']['p99'])})" for k, v in lat.items()
         if v.get("n")})
    rpcs = rpc_rows(rep)
    row("RPCs per command", {k: f"{sum(v['rpcs'].values()):g}" for k, v in rpcs.items()})
    tp = rep.get("throughput_vs_slots") or {}
    at100 = {}
    for k in keys:
        pts = tp.get(k) or []
        p = _at(pts, 100) or (max(pts, key=lambda p: p["slots"]) if pts else None)
        if p:
            at100[k] = fmt_rate(p["calls_per_s"]) + ("" if p["slots"] == 100 else
                                                     f" (N={p['slots']})")
    row("trivial commands/s, N=100 concurrent", at100)
    row("trivial commands/s, best N", {k: _best(tp.get(k)) for k in keys if tp.get(k)})
    e, m = dig(rep, "engine.result") or {}, dig(rep, "modal_rpc.result") or {}
    start = {}
    if dig(e, "cold.backend_start.median") is not None:
        start["ours_local"] = fmt_ms(e["cold"]["backend_start"]["median"])
    if m.get("starts"):
        xs = [s["start_s"] * 1e3 for s in m["starts"][1:] or m["starts"]]
        start["ours_modal"] = fmt_ms(quantile(xs, 0.5))
    if dig(m, "original.create.create_s") is not None:
        start["exec_original"] = fmt_ms(m["original"]["create"]["create_s"] * 1e3) + " (create)"
    if dig(rep, "latency.swerex_session_create_ms") is not None:
        start["swerex"] = fmt_ms(rep["latency"]["swerex_session_create_ms"]) + " (session)"
    row("start to ready (backend / sandbox / session)", start)
    if dig(e, "acquire_release.acquire_release.median") is not None:
        row("acquire + release with reset, median",
            {"ours_local": fmt_ms(e["acquire_release"]["acquire_release"]["median"])})
    mem = {}
    if dig(e, "memory.pss_mib_per_slot") is not None:
        mem["ours_local"] = (f"{e['memory']['pss_mib_per_slot']:.2f} MiB PSS "
                             f"({e['memory']['slots']} slots)")
    if dig(rep, "peer_memory.pss_mib_per_session") is not None:
        mem["swerex"] = f"{rep['peer_memory']['pss_mib_per_session']:.2f} MiB PSS"
    row("idle memory per slot / session", mem)
    ld = dig(rep, "load.result") or {}
    if ld.get("calls"):
        row(f"load: {ld.get('trajectories')} trajectories x {ld.get('steps')} steps, calls/s",
            {"ours_local": f"{fmt_rate(ld.get('calls_per_s'))} (lost {ld.get('lost')}, "
                           f"misrouted {ld.get('misrouted')}, wrong {ld.get('wrong')})"})
    return rows


def md_table(rows: list[list[str]]) -> list[str]:
    keep = [j for j in range(len(rows[0])) if j == 0 or any(r[j] for r in rows[1:])]
    rows = [[r[j] for j in keep] for r in rows]
    return ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
            *("| " + " | ".join(r) + " |" for r in rows[1:])]


def machine_line(rep: dict[str, Any]) -> str:
    m, r = rep["machine"], rep["run"]
    la = dig(rep, "load_during_run.loadavg_1m") or {}
    return (f"{m['cores']} cores ({m['cpu']}), {m['mem_total_gib']} GiB, Linux {m['kernel']}, "
            f"Python {m['python']}, cgroup {m['cgroup']}, {'root' if m['root'] else 'not root'}; "
            f"commit {m['commit']}{' with uncommitted changes' if m['uncommitted_changes'] else ''}"
            f"; {r['date']}; load average (1 min) during the run {la.get('min', 0):.1f}.."
            f"{la.get('max', 0):.1f} (median {la.get('median', 0):.1f})")


#: the rows of the headline table that go into the top-level README
TOP = ("warm", "RPCs", "trivial commands/s, N=100", "start", "idle memory")


def render_top_table(rep: dict[str, Any]) -> str:
    """The short table meant for the top-level README."""
    return "\n".join([
        f"<!-- generated by benchmarks/run_all.py from benchmarks/results/report.json "
        f"({rep['run']['date']}) -->",
        *md_table([r for i, r in enumerate(headline(rep)) if i == 0 or r[0].startswith(TOP)]),
        "", f"Measured on {machine_line(rep)}; `{rep['run']['command']}` "
            f"({minutes(rep['run']['wall_s'])}); details in "
            "[benchmarks/README.md](benchmarks/README.md)."])



def render_load_paragraph(rep: dict[str, Any]) -> str:
    """The top-level README's paragraph on the full load run (load.py's part of the report)."""
    ld = dig(rep, "load.result") or {}
    lat, own, mem = ld["latency_ms"], ld["agent_ms"], ld["mem"]
    left = "nothing left after `stop()`" if ld["clean"] else f"left after `stop()`: {ld['leftovers']}"
    return (
        f"Full load (`.venv/bin/python benchmarks/load.py`, about {ld['total_s'] / 60:.0f} minutes on "
        f"the same VM; part of\nthe run above): {ld['status']['total_slots']:,} live slots "
        f"({ld['sandboxes']} sandboxes x {ld['slots_per_sandbox']}), {ld['trajectories']:,} "
        f"trajectories x {ld['steps']} steps of\nmixed work (builtins, `python3 -c`, `write_file` "
        f"then `cat`, failures, 1 timeout in {ld['timeout_every']}\nsteps), every output checked for "
        f"its trajectory, step and slot: {ld['calls']:,} calls in {ld['wall_s']:.0f} s\n"
        f"({ld['calls_per_s']:,.0f} calls/s) with {ld['lost']} lost, {ld['misrouted']} misrouted, "
        f"{ld['wrong']} wrong; latency per trajectory step p50 {lat['p50'] / 1e3:.1f} s,\n"
        f"p99 {lat['p99'] / 1e3:.1f} s, p99.9 {lat['p99.9'] / 1e3:.1f} s (2 cores are far past "
        f"capacity, so most of it is waiting for\nadmission; a command's own run time is p50 "
        f"{own['p50']:.0f} ms, p99 {own['p99'] / 1e3:.1f} s); peak PSS "
        f"{mem['pss_peak_mib']:,.0f} MiB\n({mem['pss_peak_mib_per_slot']:.2f} MiB per slot); "
        f"{left}.")


def render_compare_row(rep: dict[str, Any]) -> str:
    """The README's comparison table row of warm round trips (median, from the latency section)."""
    lat = {k: v["ms"]["p50"] for k, v in (dig(rep, "latency.systems") or {}).items() if v.get("n")}

    def ms(k: str) -> str:
        v = lat[k]
        return f"{v:.2f} ms" if v < 1 else f"{v:.0f} ms"
    return (f"| warm command round trip (this machine) | {ms('ours_local')} local, "
            f"{ms('ours_modal')} Modal driver* | {ms('exec_original')}* | {ms('swerex')} | "
            f"{ms('langchain_modal')}* | {ms('exec_original')}* |")


def readme_figures(rep: dict[str, Any]) -> list[str]:
    """Every text of the top-level README that is made from the report, verbatim: the headline
    table with the run it came from, the full-load paragraph and the comparison row (the last
    two only when the run measured them: a partial run has neither)."""
    out = [render_top_table(rep)]
    if dig(rep, "load.result.latency_ms") is not None:
        out.append(render_load_paragraph(rep))
    systems = dig(rep, "latency.systems") or {}
    if all(dig(systems, f"{k}.ms.p50") is not None
           for k in ("ours_local", "ours_modal", "exec_original", "swerex", "langchain_modal")):
        out.append(render_compare_row(rep))
    return out

PEERS = """\
- **ours, local driver**: `ToolBackend(SandboxConfig(...))`, one persistent shell per slot in a
  bubblewrap sandbox, commands through `execute_batch`.
- **ours, Modal driver**: the same engine with `driver="modal"`: the real `modal` SDK (in this
  process) talking gRPC to the package's local Modal control plane
  (`hermes_modal_tool.testing.modal_server`, on a thread of this process; its sandboxes are
  bubblewrap containers here); commands go over one open stdin/stdout stream per sandbox.
- **exec per command (original backend)**: the original slot backend's way over the same
  control plane: `sandbox.exec("bash", "-c", cmd)`, read stdout, read stderr, `wait()`
  (`benchmarks/modal_rpc.py`'s `exec_once`, SDK `.aio` calls).
- **exec per command (langchain-modal)**: `{lc}`'s `ModalSandbox(sandbox=sb).execute(cmd)`
  (sync: `sandbox.exec("bash", "-c", cmd, timeout=1800)`, `wait()`, read stdout, read stderr),
  called from a worker thread, against the same control plane.
- **SWE-ReX session**: `swerex.runtime.local.LocalRuntime` (swe-rex {sw}), one bash session
  (pexpect) per trajectory, `run_in_session(BashAction(...))`; its calls block, so N sessions
  run in N threads with a loop each.
- **subprocess.run**: `subprocess.run(["bash", "-c", cmd], capture_output=True)`; N at once in
  a thread pool of N. No isolation and no state between calls: the floor of starting a shell.

Over the local control plane there is no network, and the server shares this machine and
this process's GIL; each exec there starts its command in a new bubblewrap container on
this machine. So the Modal columns measure the protocol's cost (RPCs, streams, the SDK's
thread hops) and this machine's process starts, not Modal's own latency (on Modal each of
those RPCs is a round trip over the network); the RPC counts are what the SDK sends, so
Modal would serve the same.
"""


def script_lines(rep: dict[str, Any]) -> list[str]:
    """The main numbers of engine.py, modal_rpc.py and load.py (those present)."""
    out = []
    e, m, ld = (dig(rep, f"{k}.result") or {} for k in SCRIPTS)
    if dig(e, "latency.ours.median") is not None:
        lat = e["latency"]
        out.append(f"- engine.py, warm `echo hi` median / p99: ours "
                   f"{fmt_ms(lat['ours']['median'])} / {fmt_ms(lat['ours']['p99'])} "
                   f"(n={lat['ours']['n']})" + "".join(
                       f", {name} {fmt_ms(lat[k]['median'])} / {fmt_ms(lat[k]['p99'])} "
                       f"(n={lat[k]['n']})" for k, name in (("swerex", "SWE-ReX session"),
                                                            ("subprocess", "subprocess.run"))
                       if dig(lat, f"{k}.median") is not None))
    for t in dig(e, "throughput.ours") or []:
        cpu = t.get("cpu_us_per_call") or {}
        runs = t.get("rounds_runs") or []
        spread = (f", median of {len(runs)} runs, {fmt_rate(min(runs))}-{fmt_rate(max(runs))}"
                  if len(runs) > 1 else "")
        out.append(f"- engine.py, {t['slots']} slots in {t['sandboxes']} sandbox(es) x "
                   f"{t['calls'] // t['slots']} rounds: {fmt_rate(t['rounds_calls_per_s'])} "
                   f"calls/s{spread} (as one batch: {fmt_rate(t['big_batch_calls_per_s'])}); CPU per "
                   f"call {sum(cpu.values()):.0f} µs ("
                   + ", ".join(f"{k} {v:.0f}" for k, v in cpu.items() if round(v)) + ")")
    for k, name in (("subprocess_threads", "subprocess.run in {workers} threads"),
                    ("swerex_threads", "SWE-ReX, {sessions} sessions in threads")):
        t = dig(e, f"throughput.{k}")
        if t and "calls_per_s" in t:
            out.append(f"- engine.py, {name.format(**t)}: {fmt_rate(t['calls_per_s'])} calls/s")
    if dig(e, "cold.backend_start.median") is not None:
        c = e["cold"]
        out.append(f"- engine.py, cold start: backend start to ready "
                   f"{fmt_ms(c['backend_start']['median'])} (n={c['backend_start']['n']}), an "
                   f"extra sandbox by pool growth {fmt_ms(dig(c, 'growth_sandbox_start.median'))}"
                   f", first command in a fresh slot "
                   f"{fmt_ms(dig(c, 'first_cmd_fresh_slot.median'))}")
    cyc = dig(e, "acquire_release.acquire_cmd_release")
    if cyc and cyc.get("median") is not None:
        paced = dig(e, "acquire_release.acquire_cmd_release_paced") or {}
        out.append(f"- engine.py, acquire + first command + release with reset: p50 "
                   f"{fmt_ms(cyc['median'])}, p99 {fmt_ms(cyc['p99'])} (n={cyc['n']}, back to back)"
                   + (f"; one cycle every {dig(e, 'acquire_release.pace_s', 0) * 1e3:.0f} ms: p50 "
                      f"{fmt_ms(paced['median'])}, p99 {fmt_ms(paced['p99'])} (n={paced['n']})"
                      if paced.get("median") is not None else ""))
    fresh = dig(e, "fresh") or {}
    if fresh.get("shells_per_s"):
        line = (f"- engine.py, the first `true` in {fresh['slots']:,} fresh slots "
                f"({fresh['sandboxes']} sandboxes, one batch): {fmt_rate(fresh['shells_per_s'])} "
                f"shells/s, {fresh['failed']} failed")
        for key, name in (("floor", "`bwrap ... true` 2 at a time"),
                          ("live_floor", "the same shells' processes without the agent")):
            per_s = dig(fresh, f"{key}.per_s")
            if per_s:
                line += (f"; {name}: {fmt_rate(per_s)}/s in the same run (ours / it: "
                         f"{fresh['shells_per_s'] / per_s:.2f})")
        out.append(line)
    if dig(e, "memory.slots") is not None:
        mm = e["memory"]
        out.append(f"- engine.py, {mm['slots']} idle slots in {mm['sandboxes']} sandboxes: "
                   f"{mm['pss_mib_per_slot']:.2f} MiB PSS and {mm['memavailable_mib_per_slot']:.2f}"
                   f" MiB of MemAvailable per slot; {mm['live_slots']}/{mm['slots']} live")
    sdk, ours_sdk = dig(rep, "agents_sdk.result.sdk_modal_client"), dig(rep, "agents_sdk.result.ours_slot_client")
    if sdk and ours_sdk:
        out.append(f"- agents_sdk.py, the OpenAI Agents SDK's sandbox session `exec`, per command: "
                   f"its own Modal client {sdk['rpcs_per_command']:g} RPCs, "
                   f"{fmt_ms(sdk['latency_ms']['median'])} median; ours (SlotSandboxClient, Modal "
                   f"driver) {ours_sdk['rpcs_per_command']:g} RPCs, "
                   f"{fmt_ms(ours_sdk['latency_ms']['median'])} median")
    if dig(m, "ours.latency.median") is not None and dig(m, "original.latency.median") is not None:
        o, g = m["ours"], m["original"]
        out.append(f"- modal_rpc.py, warm `echo hi` median / p99: ours (Modal driver) "
                   f"{fmt_ms(o['latency']['median'])} / {fmt_ms(o['latency']['p99'])}, exec per "
                   f"command {fmt_ms(g['latency']['median'])} / {fmt_ms(g['latency']['p99'])} "
                   f"(n={o['latency']['n']} / {g['latency']['n']}); 8 slots x "
                   f"{dig(o, 'throughput.rounds')} rounds: ours "
                   f"{fmt_rate(dig(o, 'throughput.calls_per_s'))} calls/s, exec per command "
                   f"{fmt_rate(dig(g, 'throughput.calls_per_s'))} calls/s")
    if ld.get("calls"):
        lat = ld.get("latency_ms") or {}
        out.append(f"- load.py, {ld.get('trajectories')} trajectories x {ld.get('steps')} steps "
                   f"({ld.get('mode')}, {ld.get('sandboxes')} sandboxes x "
                   f"{ld.get('slots_per_sandbox')}): {ld['calls']:,} calls in "
                   f"{ld.get('wall_s', 0):.0f} s, {fmt_rate(ld.get('calls_per_s'))} calls/s; per "
                   f"step p50 {fmt_ms(lat.get('p50'))}, p99 {fmt_ms(lat.get('p99'))}; lost "
                   f"{ld.get('lost')}, misrouted {ld.get('misrouted')}, wrong {ld.get('wrong')}; "
                   f"PSS peak {dig(ld, 'mem.pss_peak_mib_per_slot', math.nan):.2f} MiB per slot; "
                   + ("nothing left after stop()" if ld.get("clean") else
                      "LEFT BEHIND after stop()"))
    return out


def render_readme(rep: dict[str, Any], img: str = "results/") -> str:
    """benchmarks/README.md from the report (and nothing else)."""
    r, sz, w = rep["run"], rep["run"]["sizes"], rep["wait"]
    out = ["# Benchmarks", "",
           f"Generated by `benchmarks/run_all.py` from [`{img}report.json`]({img}report.json): "
           "every number here comes from that file (do not edit by hand; rerun).", "",
           f"**Command:** `{r['command']}` — took {minutes(r['wall_s'])}, after waiting "
           f"{w['waited_s']:.0f} s for a quiet machine (load average below {w['max_load']:g} and "
           f"fewer than {w['max_busy']:g} cores busy: {'reached' if w['quiet'] else 'not reached'};"
           f" before each section up to {w['between_sections_s']:.0f} s for the cores).", "",
           f"**Machine:** {machine_line(rep)}.", "", "## Headline", "", *md_table(headline(rep)),
           "", "Empty cells: not measured (not applicable to that system). Each system and how it "
           "ran:", "", PEERS.format(lc=dig(rep, "latency.langchain_modal_how") or "langchain-modal",
                                    sw=dig(rep, "machine.versions.swe-rex")), ""]
    lat = dig(rep, "latency.systems")
    if lat:
        out += ["## Latency", "", f"![latency]({img}latency.png)", "",
                f"`{rep['latency']['command']}` on one warm slot / session, one call at a time; "
                f"the systems take turns ({sz['lat_blocks']} turns each), so a change of load "
                "hits all alike.", "",
                "| system | n | p1 | p50 | p90 | p99 | max | failed calls |",
                "|---|---|---|---|---|---|---|---|"]
        out += [f"| {SYSTEMS[k][0]} | {v['n']} | " + " | ".join(
            fmt_ms(v["ms"][q]) for q in ("p1", "p50", "p90", "p99", "p100"))
            + f" | {v.get('errors', 0)} |" for k, v in lat.items() if v.get("n")]
        failed = [f"- {SYSTEMS[k][0]}: {v['errors']} calls failed, e.g. "
                  f"`{v['error_sample'][0]}`" for k, v in lat.items() if v.get("errors")]
        out += ["", *failed, ""] if failed else [""]
    tp = rep.get("throughput_vs_slots")
    if tp:
        ns = sorted({p["slots"] for k in SYSTEMS for p in tp.get(k) or []})
        out += ["## Throughput against the number of slots", "",
                f"![throughput vs slots]({img}throughput_vs_slots.png)", "",
                f"Trivial commands (`echo i`) per second with N slots busy at once: ours in rounds "
                f"of one `execute_batch` over N slots ({tp['per_sandbox']} slots per sandbox); "
                "peers at the same concurrency.", "",
                "| system | " + " | ".join(f"N={n}" for n in ns) + " |", "|---|" + "---|" * len(ns)]
        for k in SYSTEMS:
            if tp.get(k):
                out.append(f"| {SYSTEMS[k][0]} | " + " | ".join(
                    fmt_rate(p["calls_per_s"]) if (p := _at(tp[k], n)) else "" for n in ns) + " |")
        notes = [f"- SWE-ReX, N={p['slots']}: {p['ok']} of {p['calls']} outputs correct"
                 + (f" (e.g. `{p['errors'][0]}`)" if p.get("errors") else "")
                 for p in tp.get("swerex") or [] if p.get("ok", p["calls"]) < p["calls"]]
        notes += [f"- SWE-ReX, N={p['slots']}: failed, `{p['error']}`"
                  for p in tp.get("swerex_failed") or []]
        out += ["", *notes, ""] if notes else [""]
    sps = rep.get("throughput_vs_sps")
    if sps:
        out += ["## Throughput against `slots_per_sandbox`", "",
                f"![throughput vs slots_per_sandbox]({img}throughput_vs_slots_per_sandbox.png)", "",
                f"{sps['slots']} slots, {sz['sps_rounds']} rounds of one `execute_batch` over all "
                "of them, local driver.", "",
                "| sandboxes x slots | calls/s | round | start + acquire | PSS per slot |",
                "|---|---|---|---|---|"]
        out += [f"| {x['sandboxes']} x {x['slots_per_sandbox']} | {fmt_rate(x['calls_per_s'])} | "
                f"{fmt_ms(x['round_ms'])} | {fmt_ms(x['start_and_acquire_s'] * 1e3)} | "
                f"{x['pss_mib_per_slot']:.2f} MiB |" for x in sps["layouts"]]
        out.append("")
    mem = memory_rows(rep)
    if mem:
        out += ["## Memory per slot", "", f"![memory per slot]({img}memory_per_slot.png)", "",
                *(f"- {label}: {v:.2f} MiB" for label, v, _ in mem), "",
                "Ours from `engine.py` (idle slots with a started shell: the summed PSS of "
                "agents, bwraps and shells, and the drop of MemAvailable, per slot); the SWE-ReX "
                "session's from its bash processes and this process's growth. "
                "`subprocess.run` and exec per command keep nothing between calls.", ""]
    rpcs = rpc_rows(rep)
    if rpcs:
        out += ["## RPCs per command", "", f"![RPCs per command]({img}rpcs_per_command.png)", "",
                "| system | RPCs | by method | stream messages | n | from |",
                "|---|---|---|---|---|---|"]
        out += [f"| {SYSTEMS[k][0]} | {sum(v['rpcs'].values()):g} | " + (", ".join(
            f"{m} {c:g}" for m, c in v["rpcs"].items()) or "none") + " | " + (", ".join(
                f"{m} {c:g}" for m, c in v["stream_messages"].items()) or "none")
            + f" | {v['n']} | {v['source']} |" for k, v in rpcs.items()]
        out.append("")
    out += ["## The other scripts", "", "| script | arguments | exit | wall |", "|---|---|---|---|"]
    out += [f"| `{s['argv'][0]}` | `{' '.join(s['argv'][1:]) or '(none)'}` | {s['exit']} | "
            f"{s['wall_s']:.0f} s |" for s in (rep.get(k) for k in SCRIPTS) if s]
    out += ["", "Their full results are in the report under `engine`, `modal_rpc` and `load`; "
            "the main ones:", "", *script_lines(rep), "",
            "## Load on the machine during each section", "",
            "| section | waited before | wall | load average (start / end) | "
            "cores busy elsewhere |", "|---|---|---|---|---|"]
    out += [f"| {s['step']} | {s['waited_before_s']:.0f} s | {s['wall_s']:.0f} s | "
            f"{s['loadavg_1m_start']:.1f} / {s['loadavg_1m_end']:.1f} | "
            f"{s['other_cores_low']:.2f}..{s['other_cores']:.2f} |" for s in rep["sections"]]
    errs = rep.get("errors") or {}
    out += ["", *(f"- **{k} failed**: {v}" for k, v in errs.items())] if errs else []
    out += ["", "Cores busy elsewhere: a lower bound (processes alive through the section) and "
            "an upper bound (all busy time not ours). The load average counts our own "
            "processes too (a thousand slot shells starting raise it far above the core count).",
            ""]
    return "\n".join(out)
