"""Every benchmark and every peer in one run: a JSON report, PNG plots, benchmarks/README.md.

Runs ``engine.py``, ``modal_rpc.py`` and ``load.py`` as subprocesses (``--json``) and, in
this process, the measurements no other script makes, each system beside its peers:

- latency: the raw time of ``echo hi`` calls, interleaved in blocks across every system:
  ours (local driver), ours (Modal driver), the original slot backend's and
  ``langchain-modal``'s exec per command (both over the package's local Modal control
  plane), a SWE-ReX ``LocalRuntime`` session and ``subprocess.run``; stored as quantiles
  and a log-spaced histogram, with the RPCs per command of the Modal ones;
- throughput against the number of slots (rounds of ``execute_batch``; the peers at the
  same concurrency: a thread pool of N for ``subprocess.run``, N SWE-ReX sessions in
  threads, N concurrent execs), and against ``slots_per_sandbox`` (a fixed slot count
  packed into 1..N sandboxes), with the memory of each layout;
- the memory of an idle SWE-ReX session (the peer of an idle slot).

Usage::

    .venv/bin/python benchmarks/run_all.py            # full run (~14 min on 2 cores)
    .venv/bin/python benchmarks/run_all.py --quick    # everything small (~2 min)
    .venv/bin/python benchmarks/run_all.py --smoke --out /tmp/r   # ~30 s; for the tests
    .venv/bin/python benchmarks/run_all.py --skip load,engine --out /tmp/r

Writes ``OUT/report.json`` (default ``benchmarks/results/``), the plots ``OUT/*.png``, and
the README generated from the report: ``benchmarks/README.md`` when OUT is the default,
else ``OUT/README.md``. It prints a short table for the top-level README; every number
in both comes from ``report.json`` (``_report.render_readme`` rebuilds the README from it;
``_report.py`` makes the markdown and ``_report_plots.py`` the plots). The measurements
made in this process are in ``_run_all_latency.py`` and ``_run_all_throughput.py``, their
sizes per mode in ``_run_all_setup.py``.
A full run first waits (``--wait-idle``, up to 15 min) for a quiet machine (the 1-minute
load average below ``--max-load`` and fewer than ``--max-busy`` cores busy), and before each
section up to 3 min for the cores (``--wait-between``); the load and the cores busy
elsewhere during each section are in the report, since anything else running on the
machine skews the numbers. SIGTERM stops every backend on the way out, as Ctrl-C does.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared benchmark helpers and the other benchmarks
from _machine import READ_ONLY_GIT, LoadSampler, log, machine, section, wait_quiet  # noqa: E402
from _proc import become_subreaper, meminfo  # noqa: E402
from _report import (  # noqa: E402
    SCRIPTS,
    SYSTEMS,  # noqa: F401 - the tests read it from here
    headline,
    md_table,
    readme_figures,
    render_readme,
    render_top_table,
)
from _report_plots import plot_latency, plot_memory, plot_rpcs, plot_slots, plot_sps  # noqa: E402
from _run_all_latency import latency  # noqa: E402
from _run_all_setup import SIZES, modal_server  # noqa: E402
from _run_all_throughput import (  # noqa: E402
    swerex_memory,
    throughput_vs_slots,
    throughput_vs_sps,
)

perf = time.perf_counter
DEFAULT_OUT = HERE / "results"
OWN = ("latency", "slots", "sps", "peer_memory", "agents_sdk")


def compact(x: Any, digits: int = 5) -> Any:
    """JSON-safe and small: NaN/inf to None, floats to ``digits`` significant digits,
    lists longer than 100 cut to their first 20 items and a note of how many were left out."""
    if isinstance(x, float):
        return None if not math.isfinite(x) else float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {str(k): compact(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        if len(x) > 100:
            return [compact(v, digits) for v in x[:20]] + [f"... {len(x) - 20} more"]
        return [compact(v, digits) for v in x]
    return x


# -- the existing scripts -------------------------------------------------------------------
def run_script(name: str, args: Sequence[str], tmp: Path, timeout: float,
               python: str = sys.executable) -> dict[str, Any]:
    """Run ``benchmarks/NAME.py ARGS --json`` with ``python``; its JSON, exit status and
    wall time."""
    out, logf = tmp / f"{name}.json", tmp / f"{name}.log"
    argv = [python, str(HERE / f"{name}.py"), *args, "--json", str(out)]
    t0 = perf()
    with open(logf, "w") as fh:
        try:
            rc: int | str = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT,
                                           env=READ_ONLY_GIT, timeout=timeout,
                                           check=False).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {timeout:.0f} s"
    res: dict[str, Any] = {"argv": ["benchmarks/" + f"{name}.py", *args], "exit": rc,
                           "wall_s": perf() - t0}
    try:
        with open(out) as fh:
            res["result"] = json.load(fh)
    except (OSError, ValueError) as exc:
        res["error"] = f"no JSON ({type(exc).__name__}); output ends: " + logf.read_text()[-1500:]
    if rc != 0:
        log(f"{name}.py exited with {rc}; output ends:\n{logf.read_text()[-1500:]}")
    return res


#: agents_sdk.py's size per run mode (commands in its exec loop).
AGENTS_SDK_ARGS = {"full": ("--commands", "200"), "quick": ("--commands", "50"),
                   "smoke": ("--commands", "5")}
AGENTS_VENV_PYTHON = HERE.parent / ".venv-agents" / "bin" / "python"


def run_agents_sdk(mode: str, tmp: Path) -> dict[str, Any]:
    """The OpenAI Agents SDK's Modal sandbox client against ours, both over the local Modal
    control plane (agents_sdk.py). The SDK needs openai>=3, which cannot share .venv with
    hermes-agent: it runs with .venv-agents' Python (``bash scripts/setup.sh agents``)."""
    if not AGENTS_VENV_PYTHON.exists():
        log("agents_sdk: no .venv-agents (bash scripts/setup.sh agents); skipped")
        return {"skipped": "no .venv-agents: run `bash scripts/setup.sh agents`"}
    return run_script("agents_sdk", AGENTS_SDK_ARGS[mode], tmp, 900, str(AGENTS_VENV_PYTHON))


# -- main --------------------------------------------------------------------------------------
def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    sizes = SIZES[mode]
    full = mode == "full"
    first = args.wait_idle if args.wait_idle is not None else (900.0 if full else 0.0)
    between = (args.wait_between if args.wait_between is not None else (180.0 if full else 0.0),
               args.max_busy)
    rep: dict[str, Any] = {"machine": machine(), "sections": [],
                           "wait": {"max_load": args.max_load, "max_busy": args.max_busy,
                                    "between_sections_s": between[0],
                                    **wait_quiet(first, args.max_busy, args.max_load)}}
    started = datetime.datetime.now(datetime.timezone.utc)
    rep["run"] = {"mode": mode, "date": started.strftime("%Y-%m-%d %H:%M UTC"),
                  "command": shlex.join([".venv/bin/python", "benchmarks/run_all.py", *argv]),
                  "skipped": sorted(args.skip), "sizes": asdict(sizes),
                  "subreaper": become_subreaper()}
    t0 = perf()
    with LoadSampler() as sampler, tempfile.TemporaryDirectory(prefix="run_all-") as tmp:
        for name, timeout in (("engine", 1200), ("modal_rpc", 900)):
            if name not in args.skip:
                with section(name, rep, between):
                    rep[name] = run_script(name, getattr(sizes, name), Path(tmp), timeout)
        if "agents_sdk" not in args.skip:
            with section("agents_sdk", rep, between):
                rep["agents_sdk"] = run_agents_sdk(mode, Path(tmp))
        if "latency" not in args.skip:
            with section("latency", rep, between), modal_server() as server:
                rep["latency"] = asyncio.run(latency(sizes, server))
        if "slots" not in args.skip:
            with section("throughput vs slots", rep, between):
                rep["throughput_vs_slots"] = throughput_vs_slots(sizes)
        if "sps" not in args.skip:
            with section("throughput vs slots_per_sandbox", rep, between):
                rep["throughput_vs_sps"] = throughput_vs_sps(sizes)
        if "peer_memory" not in args.skip:
            with section("SWE-ReX session memory", rep, between):
                rep["peer_memory"] = asyncio.run(swerex_memory(sizes.swerex_sessions))
        if "load" not in args.skip:
            with section("load", rep, between):
                rep["load"] = run_script("load", sizes.load, Path(tmp), 3600)
        rep["load_during_run"] = sampler.summary()
    import modal_rpc
    rep["processes_left"] = modal_rpc.live_processes()
    rep["run"]["wall_s"] = perf() - t0
    rep["run"]["mem_available_gib_at_end"] = meminfo()["MemAvailable"] / 1024 / 1024
    return rep


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="everything small (~3 min)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for the tests (~30 s)")
    ap.add_argument("--skip", default="", type=lambda s: {x for x in s.split(",") if x},
                    help=f"comma-separated sections to leave out: {', '.join(SCRIPTS + OWN)}")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory "
                    "(default benchmarks/results; the README goes to benchmarks/README.md "
                    "only for the default)")
    ap.add_argument("--wait-idle", type=float, default=None, metavar="S",
                    help="first wait up to S s for a quiet machine: the load average below "
                         "--max-load and fewer than --max-busy cores busy (default 900 for a "
                         "full run, else 0)")
    ap.add_argument("--wait-between", type=float, default=None, metavar="S",
                    help="before each section wait up to S s for fewer than --max-busy cores "
                         "busy (default 180 for a full run, else 0)")
    ap.add_argument("--max-load", type=float, default=4.0, help="see --wait-idle (default 4)")
    ap.add_argument("--max-busy", type=float, default=0.5,
                    help="see --wait-idle (default 0.5 cores)")
    args = ap.parse_args(argv)
    unknown = args.skip - set(SCRIPTS + OWN)
    if unknown:
        ap.error(f"unknown sections in --skip: {', '.join(sorted(unknown))}")
    threading.current_thread().name = "run_all"
    signal.signal(signal.SIGTERM, _interrupt)  # stop every backend on the way out
    rep = compact(run(args, argv))
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(rep, indent=1, allow_nan=False) + "\n"
    (out / "report.json").write_text(text)
    rep = json.loads(text)  # the README is made from exactly what the file holds
    for plot in (plot_latency, plot_slots, plot_sps, plot_memory, plot_rpcs):
        name = plot(rep, out)
        log(f"wrote {out / name}" if name else f"{plot.__name__}: nothing to plot")
    readme = HERE / "README.md" if out == DEFAULT_OUT.resolve() else out / "README.md"
    readme.write_text(render_readme(rep, "results/" if readme.parent != out else ""))
    log(f"wrote {out / 'report.json'} and {readme}")
    print("\n".join(md_table(headline(rep))))
    print("\n---- table for the top-level README (from report.json) ----")
    print(render_top_table(rep))
    print("---- end of the table for the top-level README ----")
    # The README's other figures from this run (tests/test_run_all.py checks them there).
    print("\n\n".join(readme_figures(rep)[1:]))
    print(f"total wall time: {rep['run']['wall_s']:.0f} s")
    return 0 if not rep.get("errors") and not rep["processes_left"] else 1


if __name__ == "__main__":
    sys.exit(main())
