"""notebooks/openai_adapter.ipynb runs top to bottom (with the .venv's ipykernel) and is
committed with its outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient
from support import assert_outputs_current

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "openai_adapter.ipynb"


def outputs_text(nb: nbformat.NotebookNode) -> str:
    return "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                   for out in cell.get("outputs", []))


def test_notebook_is_committed_with_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count for c in code)
    assert "hello from the sandbox" in outputs_text(nb)
    assert not any(out.get("output_type") == "error" for c in code for out in c.outputs)


def test_notebook_runs() -> None:
    committed = nbformat.read(NOTEBOOK, as_version=4)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=60, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()  # raises on error
    text = outputs_text(nb)
    assert "/proj\\n[exit code 0]" in text  # `cd proj` stuck between turns
    assert "assistant: I wrote and ran proj/hello.py" in text
    assert "hello from the sandbox\n[exit code 0]" in text
    assert "requests served: 4" in text
    assert_outputs_current(committed, nb)
