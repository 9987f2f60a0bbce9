"""notebooks/modal_backend.ipynb runs top to bottom (with the .venv's ipykernel) against the
package's local Modal control plane, and is committed with its outputs."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from support import committed_notebook, notebook_text

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "modal_backend.ipynb"


def check_story(text: str) -> None:
    assert "running on the local Modal control plane" in text
    assert ("pytorch-gpu  driver=modal image=pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime "
            "gpu=T4") in text
    assert "alice: /data/slot_0   bob: /data/slot_1" in text
    assert "alice exit=0   /data/slot_0/proj | STAGE=build" in text  # cd and export stuck
    assert "alice exit=0   hello from the sandbox" in text
    assert "bob   exit=0   /data/slot_1 | STAGE=unset" in text  # bob's slot is apart
    assert "bob   exit=124 working" in text and "never" not in text  # timeout keeps the output
    assert "bob   exit=0   still here in /data/slot_1" in text
    assert "RPCs: {}\n" in text and "RPCs per command: 0.0" in text  # no RPC per warm command
    assert re.search(r"stream messages: \{'TaskExecStdinWriteStream': \d+\}", text)
    assert re.search(r"pytorch-gpu  gpu=T4 cpu=1.0 memory=16384 .* status=running", text)
    assert "'live_sandboxes': 2, 'created': 2" in text
    assert "sandboxes on the server after stop: ['finished']" in text


def test_notebook_is_committed_with_outputs() -> None:
    nb = committed_notebook(NOTEBOOK)
    check_story(notebook_text(nb))


def test_notebook_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # The local server path even where Modal credentials exist (or a test session's local
    # server left its MODAL_* variables set): the kernel inherits this environment.
    monkeypatch.setenv("HMT_NOTEBOOK_LOCAL", "1")
    for key in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "MODAL_SERVER_URL", "MODAL_CONFIG_PATH",
                "MODAL_PROFILE", "MODAL_ENVIRONMENT"):
        monkeypatch.delenv(key, raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()  # raises
    check_story(notebook_text(nb))
