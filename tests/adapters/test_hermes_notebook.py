"""notebooks/hermes_adapter.ipynb runs top to bottom (with the .venv's ipykernel) and is
committed with its outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient
from support import assert_outputs_current, committed_notebook, notebook_text

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "hermes_adapter.ipynb"


def check_story(text: str) -> None:
    assert "True" in text.splitlines()[0]  # check_terminal_requirements()
    assert "  /workspace/proj\n  42" in text  # alice's cd stuck; her file ran
    assert "[bob] $ pwd && ls -A\n  exit_code=0 error=None\n  /workspace\n" in text  # bob's own, empty
    assert "exit_code=124" in text and "  working" in text  # timeout keeps the output
    assert "still here in /workspace" in text
    assert "{'alice': '/data/slot_0', 'bob': '/data/slot_1'}" in text
    assert "[alice] $ ls -A\n  exit_code=0 error=None\n" in text  # emptied by cleanup_vm
    assert "2 tasks released" in text


def test_notebook_is_committed_with_outputs() -> None:
    nb = committed_notebook(NOTEBOOK)
    check_story(notebook_text(nb))


def test_notebook_runs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    committed = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    NotebookClient(nb, timeout=60, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()  # raises on error
    check_story(notebook_text(nb))
    assert_outputs_current(committed, nb)
