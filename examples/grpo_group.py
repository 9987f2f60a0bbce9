"""A GRPO-style group: 4 tasks, each set up once, 8 rollouts per task forked from it.

Writes ``examples/grpo_group.jsonl`` and runs it with ``hermes-modal-tool batch`` twice:
with forks (each task's setup runs once, keyed by its content; its 8 rollouts start
from the snapshot) and with ``--no-fork`` (every rollout redoes its task's setup), then
prints per-task setup time, per-rollout time and the totals side by side.

Each task's setup makes a small Python project whose tests import a dependency,
``gradekit``, installed with pip from a wheel this script builds (no network): the
wheel travels base64-encoded in the setup commands. Each rollout tries a different fix
of the project's bug and runs the tests; its reward is whether they pass.

Usage (as root, for the slots' layered roots)::

    .venv/bin/python examples/grpo_group.py             # write the file, run both, compare
    .venv/bin/python examples/grpo_group.py --write-only
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
JSONL = HERE / "grpo_group.jsonl"
WHEEL = "gradekit-1.0-py3-none-any.whl"
GRADEKIT = '''"""Tiny helpers the tasks' code and tests use."""


def clamp(x, lo, hi):
    return max(lo, min(hi, x))


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0
'''
#: name -> (module source with BUG, the bug's text, tests, the right fix)
TASKS = {
    "scores": ("from gradekit import clamp\n\ndef normalise(x):\n    return clamp(x BUG 100, 0.0, 1.0)\n",
               "BUG", "from app import normalise\nassert normalise(50) == 0.5\nassert normalise(250) == 1.0\n",
               "/"),
    "average": ("from gradekit import mean\n\ndef spread(xs):\n    return max(xs) BUG mean(xs)\n",
                "BUG", "from app import spread\nassert spread([1, 2, 3]) == 1.0\nassert spread([4, 4]) == 0.0\n",
                "-"),
    "window": ("from gradekit import clamp\n\ndef index(i, n):\n    return clamp(i, 0, n BUG 1)\n",
               "BUG", "from app import index\nassert index(9, 5) == 4\nassert index(-3, 5) == 0\n",
               "-"),
    "ratio": ("from gradekit import mean\n\ndef share(part, whole):\n    return 0.0 if whole == 0 else part BUG whole\n",
              "BUG", "from app import share\nassert share(1, 4) == 0.25\nassert share(3, 0) == 0.0\n",
              "/"),
}
CANDIDATES = ["+", "-", "*", "/", "//", "%", "**", "-"]  # 8 rollouts per task, one fix each


def wheel_bytes() -> bytes:
    """A pure-Python wheel of ``gradekit`` (built here: no network, no build tools)."""
    buf = io.BytesIO()
    files = {"gradekit/__init__.py": GRADEKIT,
             "gradekit-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: gradekit\nVersion: 1.0\n",
             "gradekit-1.0.dist-info/WHEEL": ("Wheel-Version: 1.0\nGenerator: grpo_group.py\n"
                                              "Root-Is-Purelib: true\nTag: py3-none-any\n"),
             "gradekit-1.0.dist-info/RECORD": ""}
    with zipfile.ZipFile(buf, "w") as z:
        for name, text in files.items():  # fixed dates: the same wheel (and file) every run
            z.writestr(zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0)), text)
    return buf.getvalue()


def setup_commands(name: str) -> list[str]:
    module, _bug, tests, _fix = TASKS[name]
    wheel = base64.b64encode(wheel_bytes()).decode()
    return [
        f"mkdir -p /workspace/{name} && cd /workspace/{name} && export TASK={name}",
        f"echo {wheel} | base64 -d > /tmp/{WHEEL} && python3 -m pip install -q --no-index --no-deps "
        f"--disable-pip-version-check --root-user-action=ignore /tmp/{WHEEL}",
        f"cat > app.py <<'EOF'\n{module}EOF\ncat > test_app.py <<'EOF'\n{tests}EOF\n"
        "python3 -c 'import gradekit; print(\"gradekit\", gradekit.mean([1, 2]))'",
    ]


def rollouts() -> list[dict]:
    lines = []
    for name in TASKS:
        for k, op in enumerate(CANDIDATES):
            fix = f"sed -i 's|BUG|{op}|' app.py && python3 test_app.py && echo reward=1 || echo reward=0"
            lines.append({"id": f"{name}-{k}", "setup": setup_commands(name),
                          "meta": {"task": name, "fix": op},
                          "calls": [{"tool": "bash", "args": {"command": "echo $TASK; pwd"},
                                     "expect": {"output_contains": f"/workspace/{name}"}},
                                    {"tool": "bash", "args": {"command": fix},
                                     "expect": {"output_contains": "reward="}}]})
    return lines


def write() -> None:
    with open(JSONL, "w") as fh:
        for line in rollouts():
            fh.write(json.dumps(line) + "\n")


def run(no_fork: bool, slots: int) -> tuple[list[dict], str]:
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as out:
        path = out.name
    cmd = [sys.executable, "-c", "from hermes_modal_tool.cli import main; main()", "batch", str(JSONL), "-o", path,
           "--no-progress", "--slots-per-sandbox", str(slots), "--max-sandboxes", "1", "--timeout", "300"]
    if no_fork:
        cmd.append("--no-fork")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    try:
        records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    finally:
        os.unlink(path)
    if proc.returncode != 0:
        errors = "\n".join(f"{r['id']}: {r['error'] or r['steps']}"[:1500] for r in records if not r["ok"])
        raise SystemExit(f"batch failed (exit {proc.returncode}):\n{errors[:6000]}\n{proc.stderr[-2000:]}")
    return records, proc.stderr + proc.stdout


def report(records: list[dict]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name in TASKS:
        mine = [r for r in records if r["meta"]["task"] == name]
        rewards = [int("reward=1" in r["steps"][-1]["output"]) for r in mine]
        out[name] = {"setup_s": max(r.get("setup_s", 0.0) for r in mine),
                     "rollout_s": statistics.median(r.get("rollout_s", 0.0) for r in mine),
                     "solved": sum(rewards)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write-only", action="store_true", help="only write examples/grpo_group.jsonl")
    ap.add_argument("--slots", type=int, default=36, help="slots in the one sandbox (default 36)")
    args = ap.parse_args()
    write()
    print(f"wrote {JSONL} ({len(TASKS)} tasks x {len(CANDIDATES)} rollouts)")
    if args.write_only:
        return 0
    results = {}
    for mode, no_fork in (("forks", False), ("no fork", True)):
        records, log = run(no_fork, args.slots)
        wall = next((line.split("│")[-2] if line.count("│") > 1 else line for line in log.splitlines()
                     if "wall time" in line), "").strip()
        results[mode] = (report(records), wall)
    print(f"\n{'task':10} {'mode':8} {'setup (max) s':>14} {'rollout (median) s':>19} {'solved':>7}")
    for name in TASKS:
        for mode, (rep, _) in results.items():
            r = rep[name]
            print(f"{name:10} {mode:8} {r['setup_s']:14.2f} {r['rollout_s']:19.3f} {r['solved']:>5}/8")
    for mode, (_, wall) in results.items():
        print(f"total, {mode}: {wall}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
