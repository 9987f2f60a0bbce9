"""benchmarks/run_all.py: a tiny run writes the report, the plots and the README; and the
committed benchmarks/README.md is exactly what the committed report.json renders to, and so
are the figures of the top-level README that come from it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
_spec = importlib.util.spec_from_file_location("hmt_run_all", BENCH / "run_all.py")
run_all = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = run_all
_spec.loader.exec_module(run_all)

PLOTS = ("latency.png", "throughput_vs_slots.png", "throughput_vs_slots_per_sandbox.png",
         "memory_per_slot.png", "rpcs_per_command.png")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_smoke_run_writes_report_plots_and_readme(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH / "run_all.py"), "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0, output
    rep = json.loads((tmp_path / "report.json").read_text())

    for key in ("cpu", "cores", "mem_total_gib", "kernel", "python", "cgroup", "root", "commit"):
        assert key in rep["machine"], key
    assert rep["run"]["mode"] == "smoke" and rep["run"]["wall_s"] > 0
    assert "loadavg_1m" in rep["load_during_run"] and rep["sections"]
    assert not rep.get("errors") and rep["processes_left"] == []
    for name in run_all.SCRIPTS:
        assert rep[name]["exit"] == 0 and "result" in rep[name], rep[name]
    lat = rep["latency"]["systems"]
    assert set(lat) == set(run_all.SYSTEMS)
    for key, d in lat.items():
        assert d["n"] > 0 and 0 < d["ms"]["p50"] <= d["ms"]["p99"], (key, d)
        assert d["errors"] == 0 or key == "swerex", (key, d)  # SWE-ReX gives up when slow
        assert sum(d["hist"].values()) == d["n"], key
    assert lat["ours_modal"]["per_command"]["rpcs"] == {}  # commands ride open streams
    assert sum(lat["langchain_modal"]["per_command"]["rpcs"].values()) >= 3  # exec, read, wait
    tp = rep["throughput_vs_slots"]
    for key in ("ours_local", "ours_modal", "exec_original", "swerex", "subprocess"):
        assert tp[key] and all(p["calls_per_s"] > 0 for p in tp[key]), key
    assert all(p.get("wrong_outputs", 0) == 0 for p in tp["ours_local"] + tp["ours_modal"])
    layouts = rep["throughput_vs_sps"]["layouts"]
    assert [x["sandboxes"] for x in layouts] == list(run_all.SIZES["smoke"].sps_sandboxes)
    assert rep["peer_memory"]["pss_mib_per_session"] > 0

    for name in PLOTS:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and 1_000 < len(data) < 150_000, name
    assert (tmp_path / "README.md").read_text() == run_all.render_readme(rep, img="")
    assert "table for the top-level README" in proc.stdout
    assert run_all.render_top_table(rep) in proc.stdout


def test_committed_readme_matches_committed_report():
    rep = json.loads((BENCH / "results" / "report.json").read_text())
    readme = (BENCH / "README.md").read_text()
    assert readme == run_all.render_readme(rep), (
        "benchmarks/README.md is not what benchmarks/results/report.json renders to: "
        "rerun benchmarks/run_all.py")
    assert rep["run"]["mode"] == "full"
    for name in PLOTS:
        assert (BENCH / "results" / name).read_bytes().startswith(PNG_SIGNATURE), name
        assert f"](results/{name})" in readme, name


def test_top_level_readme_figures_are_the_committed_reports():
    """The README's headline table (with the run that made it), its full-load paragraph and
    its comparison row are, verbatim, what benchmarks/results/report.json renders to: a
    stale figure, or one edited by hand, fails here."""
    rep = json.loads((BENCH / "results" / "report.json").read_text())
    readme = (BENCH.parent / "README.md").read_text()
    figures = run_all.readme_figures(rep)
    assert len(figures) == 3  # the committed run measured all of them
    for text in figures:
        assert text in readme, (
            "README.md does not hold this text that benchmarks/results/report.json renders to "
            f"(rerun benchmarks/run_all.py and paste what it prints):\n{text}")
