"""What ``modal_rpc.py`` prints: its tables (rich) from the result dict it also writes as
JSON: the cost per warm command (ours against the original), one-time costs, where our time
goes (``_modal_rpc_hops.py``'s legs and floors), the checks, and the CPU during each step.
"""

from __future__ import annotations

from typing import Any

from _engine_render import fmt_lat, fmt_ms
from _modal_rpc_base import SLOTS
from _modal_rpc_hops import FLOORS, LEGS
from rich.console import Console
from rich.table import Table


def fmt_counts(counts: dict[str, float]) -> str:
    if not counts:
        return "none"
    return ", ".join(f"{k} {v:g}" if v == int(v) else f"{k} {v:.2f}" for k, v in counts.items())


def render(res: dict[str, Any], console: Console) -> None:
    m, o, g = res["machine"], res["ours"], res["original"]
    n = o["latency"]["n"]
    console.print(f"[bold]Modal RPC benchmark[/bold]: local Modal control plane "
                  f"(isolation {res['server']['isolation']}, sandbox API "
                  f"V{'/'.join(map(str, res['server']['api_versions']))}), modal {m['modal']}, "
                  f"Python {m['python']}, {m['nproc']} cores ({m['cpu']}), load average "
                  f"{m['loadavg_1m']:.1f} at the start{', QUICK run' if res['quick'] else ''}")

    t = Table(title=f"Per warm command: `{res['command']}`, {n} sequential calls on one slot; "
                    f"throughput: {SLOTS} slots x {o['throughput']['rounds']} rounds",
              title_justify="left")
    t.add_column("")
    t.add_column("ours: one long-lived exec, stdio streams", overflow="fold")
    t.add_column("original: sandbox.exec per command", overflow="fold")
    ol, gl = o["latency"], g["latency"]
    t.add_row("RPCs per command", f"{sum(ol['rpcs_per_command'].values()):g}",
              f"{sum(gl['rpcs_per_command'].values()):g}")
    t.add_row("  by method", fmt_counts(ol["rpcs_per_command"]), fmt_counts(gl["rpcs_per_command"]))
    t.add_row("stream request messages per command", fmt_counts(ol["stream_messages_per_command"]),
              fmt_counts(gl["stream_messages_per_command"]))
    cut = f" (n = {gl['n']}: time budget {gl['budget_s']:g} s)" if gl["n"] < gl["wanted"] else ""
    t.add_row("latency median / p90 / p99", fmt_lat(ol), fmt_lat(gl) + cut)
    t.add_row("  agent-side run time, median", fmt_ms(ol["agent_side_median_ms"]), "")
    ot, gt = o["throughput"], g["throughput"]
    t.add_row(f"throughput ({ot['calls']} calls)",
              f"{ot['calls_per_s']:,.0f} calls/s ({fmt_ms(ot['round_ms'])} per batch of {SLOTS}); "
              f"{sum(ot['rpcs'].values())} RPCs",
              f"{gt['calls_per_s']:,.0f} calls/s ({SLOTS} concurrent execs, "
              f"{fmt_ms(gt['round_ms'])} per round); "
              f"{sum(gt['rpcs_per_command'].values()):g} RPCs per call")
    t.add_row("stdin bytes per command", f"{ol['stdin_bytes_per_command']:.0f}", "")
    console.print(t)

    t = Table(title="One-time costs", title_justify="left")
    t.add_column("")
    t.add_column("wall")
    t.add_column("RPCs")
    t.add_column("by method (stream request messages)", overflow="fold")

    def row(label: str, wall: float, counts: dict[str, Any]) -> None:
        sm = counts.get("stream_messages") or {}
        extra = f" ({fmt_counts(sm)})" if sm else ""
        t.add_row(label, fmt_ms(wall * 1e3), str(sum(counts["rpcs"].values())),
                  fmt_counts(counts["rpcs"]) + extra)

    st = res["starts"]
    row("ours: start() to ready, first in this process", st[0]["start_s"], st[0])
    if len(st) > 1:
        later = sorted(st[1:], key=lambda x: x["start_s"])[(len(st) - 2) // 2]
        row(f"ours: start() to ready, later (median of {len(st) - 1})", later["start_s"], later)
    row("ours: an extra sandbox (acquire -> pool growth)", o["growth"]["acquire_s"], o["growth"])
    row(f"ours: stop() ({o['growth']['sandboxes']} sandboxes)", o["stop"]["stop_s"], o["stop"])
    row("original: Sandbox.create", g["create"]["create_s"], g["create"])
    row("original: sandbox.terminate", g["terminate"]["terminate_s"], g["terminate"])
    t.add_row("ours: acquire 8 slots / release 9 with reset", "",
              f"{sum(o['acquire_8']['rpcs'].values())} / "
              f"{sum(o['release_9_with_reset']['rpcs'].values())}", "")
    console.print(t)

    bd = o["breakdown"]
    t = Table(title=f"Where our time per command goes ({bd['total']['n']} commands; "
                    "the legs' medians need not add up)", title_justify="left")
    t.add_column("")
    t.add_column("median")
    t.add_column("p90")
    for key in LEGS:
        t.add_row(key, fmt_ms(bd[key]["median"]), fmt_ms(bd[key]["p90"]))
    t.add_row("  of which the agent's own run time", fmt_ms(bd["agent_side"]["median"]),
              fmt_ms(bd["agent_side"]["p90"]))
    t.add_row("[bold]total[/bold]", fmt_ms(bd["total"]["median"]), fmt_ms(bd["total"]["p90"]))
    lo = res.get("local_driver", {})
    if "median" in lo:
        t.add_row("ref: the same command on the local driver (no Modal)",
                  fmt_ms(lo["median"]), fmt_ms(lo["p90"]))
    else:
        t.add_row("ref: local driver", lo.get("error", "n/a"), "")
    fl = g["transport_floor"]
    for key, label in FLOORS.items():
        t.add_row(label, fmt_ms(fl[key]["median"]), fmt_ms(fl[key]["p90"]))
    t.add_row("ref: one .aio call of a no-op coroutine (two thread hops)",
              fmt_ms(fl["aio_noop_call"]["median"]), fmt_ms(fl["aio_noop_call"]["p90"]))
    console.print(t)

    c = res["checks"]
    ok = "[green]PASS[/green]" if c["ok"] else "[red]FAIL[/red]"
    console.print(f"Checks {ok}: RPCs by our driver during {n + ot['calls']} warm commands: "
                  f"{c['ours_rpcs_during_warm_commands']}; left running after stop: ours "
                  f"{c['ours_left_running'] or 'none'}, original "
                  f"{c['original_left_running'] or 'none'}; "
                  f"live processes left: {c['processes_left'] or 'none'}; wrong outputs: "
                  f"{c['wrong_outputs']}")
    t = Table(title="CPU during each step: a shared machine skews the times", title_justify="left")
    for col in ("step", "wall", "ours (cores)", "other processes (cores, lower..upper bound)"):
        t.add_column(col)
    for x in res["cpu_log"]:
        t.add_row(x["step"], f"{x['wall_s']:.1f} s", f"{x['own_cores']:.2f}",
                  f"{x['other_cores_low']:.2f}..{x['other_cores']:.2f}")
    console.print(t)
    console.print(f"total wall time: {res['wall_s']:.1f} s")
