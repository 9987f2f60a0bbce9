"""The report's plots (PNG) of benchmarks/run_all.py, made from ``report.json`` only.

Each ``plot_*`` function reads the report dict that ``run_all.py`` wrote (or the committed
``benchmarks/results/report.json``) and saves one PNG in ``out``; it returns the file's
name, or None when the report holds nothing to plot. The markdown is in :mod:`_report`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _report import HIST_LO_S, HIST_PER_DECADE, SYSTEMS, dig, fmt_ms, memory_rows, rpc_rows


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def _log_ticks(ax: Any, xs: Sequence[int]) -> None:
    """A log x axis with a labelled tick at each measured x (and no others)."""
    ax.set_xscale("log")
    ax.set_xticks(list(xs), [str(x) for x in xs])
    ax.minorticks_off()


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _plt().close(fig)
    return path.name


def plot_latency(rep: dict[str, Any], out: Path) -> str | None:
    systems = {k: v for k, v in (dig(rep, "latency.systems") or {}).items() if v.get("n")}
    if not systems:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(systems), 1, figsize=(8, 1.25 * len(systems) + 0.9), sharex=True)
    axes = [axes] if len(systems) == 1 else axes

    def edge(i: int) -> float:  # the lower edge of histogram bin i, ms
        return HIST_LO_S * 10 ** (i / HIST_PER_DECADE) * 1e3

    for ax, (key, d) in zip(axes, systems.items(), strict=True):
        label, colour = SYSTEMS[key]
        for i, c in d["hist"].items():
            ax.bar(edge(int(i)), c / d["n"], width=edge(int(i) + 1) - edge(int(i)), align="edge",
                   color=colour, alpha=0.8)
        ax.axvline(d["ms"]["p50"], color="black", lw=1)
        ax.set_ylabel("share", fontsize=7)
        ax.set_title(f"{label}: median {fmt_ms(d['ms']['p50'])}, p99 {fmt_ms(d['ms']['p99'])} "
                     f"(n={d['n']})", fontsize=8, loc="left")
    axes[-1].set_xscale("log")
    axes[-1].set_xlabel(f"`{dig(rep, 'latency.command')}` round trip, ms (log); line: median")
    return _save(fig, out / "latency.png")


def plot_slots(rep: dict[str, Any], out: Path) -> str | None:
    tp = rep.get("throughput_vs_slots")
    if not tp:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    what = {"ours_local": "", "ours_modal": " (local control plane)",
            "exec_original": " (N concurrent execs, local control plane)",
            "swerex": " (N sessions in threads)", "subprocess": " (thread pool of N)"}
    for key, extra in what.items():
        pts = tp.get(key) or []
        if pts:
            label, colour = SYSTEMS[key]
            ax.plot([p["slots"] for p in pts], [p["calls_per_s"] for p in pts], "o-",
                    color=colour, label=label + extra)
    _log_ticks(ax, sorted({p["slots"] for k in what for p in tp.get(k) or []}))
    ax.set_yscale("log")
    ax.set_xlabel(f"slots (concurrent calls); ours: {tp['per_sandbox']} slots per sandbox")
    ax.set_ylabel("trivial commands per second (log)")
    ax.legend(fontsize=8)
    return _save(fig, out / "throughput_vs_slots.png")


def plot_sps(rep: dict[str, Any], out: Path) -> str | None:
    lay = dig(rep, "throughput_vs_sps.layouts")
    if not lay:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    names = [f"{x['sandboxes']} x {x['slots_per_sandbox']}" for x in lay]
    bars = ax.bar(names, [x["calls_per_s"] for x in lay], color=SYSTEMS["ours_local"][1])
    for b, x in zip(bars, lay, strict=True):
        ax.annotate(f"{x['calls_per_s']:,.0f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xlabel(f"{rep['throughput_vs_sps']['slots']} slots as sandboxes x slots_per_sandbox "
                  "(local driver)")
    ax.set_ylabel("trivial commands per second")
    return _save(fig, out / "throughput_vs_slots_per_sandbox.png")


def plot_memory(rep: dict[str, Any], out: Path) -> str | None:
    mem = memory_rows(rep)
    lay = dig(rep, "throughput_vs_sps.layouts") or []
    if not mem and not lay:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2 if lay else 1, figsize=(9, 4), squeeze=False)
    ax = axes[0][0]
    ax.barh([m[0] for m in mem], [m[1] for m in mem], color=[m[2] for m in mem])
    for i, m in enumerate(mem):
        ax.annotate(f" {m[1]:.2f}", (m[1], i), va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("MiB per idle slot / session")
    if lay:
        ax = axes[0][1]
        ax.plot([x["slots_per_sandbox"] for x in lay], [x["pss_mib_per_slot"] for x in lay], "o-",
                color=SYSTEMS["ours_local"][1])
        _log_ticks(ax, [x["slots_per_sandbox"] for x in lay])
        ax.set_ylim(bottom=0)
        ax.set_xlabel(f"slots_per_sandbox ({rep['throughput_vs_sps']['slots']} slots, "
                      "local driver)")
        ax.set_ylabel("ours: PSS MiB per slot")
    return _save(fig, out / "memory_per_slot.png")


def plot_rpcs(rep: dict[str, Any], out: Path) -> str | None:
    rows = rpc_rows(rep)
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    methods = sorted({m for r in rows.values() for m in r["rpcs"]})
    names = [SYSTEMS[k][0] for k in rows]
    bottom = [0.0] * len(rows)
    cmap = plt.get_cmap("tab10")
    for j, m in enumerate(methods):
        vals = [r["rpcs"].get(m, 0.0) for r in rows.values()]
        ax.barh(names, vals, left=bottom, label=m, color=cmap(j))
        bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
    for i, (total, r) in enumerate(zip(bottom, rows.values(), strict=True)):
        sm = sum(r["stream_messages"].values())
        ax.annotate(f" {total:g} RPCs, {sm:g} stream messages", (total, i), va="center",
                    fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(bottom + [1]) * 2.0)
    ax.set_xlabel("RPCs per warm command (by method), local Modal control plane")
    if methods:
        ax.legend(fontsize=7, loc="upper right")
    return _save(fig, out / "rpcs_per_command.png")
