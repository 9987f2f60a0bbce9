"""notebooks/quickstart.ipynb and notebooks/rl_rollouts.ipynb run top to bottom (with the
.venv's ipykernel) and are committed with their outputs (the RL one with its plots as PNG)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from support import notebook_text

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def png_count(nb: nbformat.NotebookNode) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells
               if cell.cell_type == "code" for out in cell.get("outputs", []))


def check_quickstart(nb: nbformat.NotebookNode) -> None:
    text = notebook_text(nb)
    assert "pool 'quickstart' ready in" in text
    assert "alice: /data/slot_0   bob: /data/slot_1" in text
    assert "alice exit=0   /data/slot_0/proj | STAGE=build" in text  # cd and export stuck
    assert "alice exit=0   wrote 32 bytes to /data/slot_0/proj/hello.py" in text
    assert "alice exit=0   print('hello from the sandbox')" in text  # read_file
    assert "alice exit=0   hello from the sandbox" in text
    assert "bob   exit=0   /data/slot_1 | STAGE=unset" in text  # bob's slot is apart
    assert "bob   exit=124 working" in text  # the timeout keeps the output so far
    assert "bob   exit=0   still here in /data/slot_1" in text
    assert re.search(r"│ quickstart \* │ 1/1 +│ 2/4 +│ 8 +│ 1 +│ 1 +│ bwrap", text)  # status
    assert "sandboxes after stop: 0" in text
    assert '{"output": "hello from /workspace/work\\n", "exit_code": 0, "error": null}' in text
    assert "1 task released" in text


def check_rl_rollouts(nb: nbformat.NotebookNode) -> None:
    text = notebook_text(nb)
    assert re.search(r"rollouts ━+ 24/24 ", text)  # the progress bar's final state, as text
    assert "24 trajectories x 6 steps = 144 tool calls in" in text
    assert re.search(r"latency per call: p50 [\d.]+ ms, p99 [\d.]+ ms", text)
    assert "successes: 21/24 (reward 1.0); reward 0: traj-05, traj-13, traj-21" in text
    assert "timeouts (exit code 124, expected): 4" in text
    # Every call counted; failures are the 24 deliberate ones and the 4 timeouts.
    assert re.search(r"\{'calls': 144, 'failures': 28, 'timeouts': 4, "
                     r"'calls_per_second': [\d.]+, 'waiting_acquires': 0\}", text)
    assert "'acquired_slots': 0, 'acquires': 24" in text
    assert "sandboxes after stop: 0" in text
    assert png_count(nb) >= 2  # the latency bars and the per-tool histograms


CASES: dict[str, Callable[[nbformat.NotebookNode], None]] = {
    "quickstart.ipynb": check_quickstart,
    "rl_rollouts.ipynb": check_rl_rollouts,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_notebook_is_committed_with_outputs(name: str) -> None:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count for c in code)
    assert not any(out.get("output_type") == "error" for c in code for out in c.outputs)
    CASES[name](nb)


@pytest.mark.parametrize("name", sorted(CASES))
def test_notebook_runs(name: str) -> None:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()  # raises on error
    CASES[name](nb)
