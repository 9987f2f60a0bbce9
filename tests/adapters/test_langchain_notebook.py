"""``notebooks/langchain_adapter.ipynb`` runs top to bottom and says what it claims.

Executed with nbclient in a ``python3`` kernel (this interpreter: jupyter_client
swaps the kernelspec's ``python`` for ``sys.executable``); the committed file keeps
its outputs and is not rewritten here.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient
from support import assert_outputs_current

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "langchain_adapter.ipynb"


def text_of(cell: nbformat.NotebookNode) -> str:
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text") or out.get("data", {}).get("text/plain", ""))
        if out.get("output_type") == "error":
            parts.append(f"{out['ename']}: {out['evalue']}")
    return "".join(parts)


def check(nb: nbformat.NotebookNode) -> None:
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "every code cell has run"
    assert not any(o.get("output_type") == "error" for c in code for o in c.outputs)
    outputs = "\n".join(text_of(c) for c in code)
    # cd and export persist within thread a ...
    assert outputs.count("/data/slot_0/proj\nSTAGE=test") == 2
    assert "hello from thread a" in outputs
    # ... thread b has its own empty slot ...
    assert "--- bash -> /data/slot_1\ncat: proj/app.py: No such file or directory\n[exit code 1]" in outputs
    # ... and failures are tool output.
    assert "[exit code 124: command timed out after 1s" in outputs
    assert "--- read_file -> Error: no such file: /data/slot_0/proj/missing.txt" in outputs
    assert "(124, True)" in outputs
    assert "released 2 slots" in outputs


def test_committed_notebook_has_its_outputs() -> None:
    check(nbformat.read(NOTEBOOK, as_version=4))


def test_notebook_runs_top_to_bottom() -> None:
    committed = nbformat.read(NOTEBOOK, as_version=4)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    NotebookClient(nb, timeout=120, kernel_name="python3", extra_arguments=["--log-level=ERROR"],
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    check(nb)
    assert_outputs_current(committed, nb)  # e.g. a read_file error the tool no longer gives
