"""notebooks/openai_agents_adapter.ipynb runs top to bottom (in .venv-agents, with the
Agents SDK) and is committed with its outputs."""

from __future__ import annotations

from pathlib import Path

from support import committed_notebook, executed_notebook, notebook_text, require_agents_sdk

require_agents_sdk()

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "openai_agents_adapter.ipynb"


def check(text: str) -> None:
    assert "Process exited with code 0\nOutput:\n42\n" in text  # the SDK's exec_command, via a slot
    assert "model requests: 4 | slots held now: 0" in text
    a = next(line for line in text.splitlines() if line.startswith("a ['/data/slot_"))
    b = next(line for line in text.splitlines() if line.startswith("b ['/data/slot_"))
    assert a.split("'")[1] != b.split("'")[1]  # two runs, two slots
    assert "sandboxes: 1" in text
    assert "b'to-stdout\\n' b'to-stderr\\n' 3" in text
    assert "supports_pty: True" in text and "running after close: False" in text
    assert "REPL session: True | prompt: >>>" in text and "REPL printed: 42 | exit code: 4" in text
    assert "stopped" in text


def test_notebook_is_committed_with_outputs() -> None:
    check(notebook_text(committed_notebook(NOTEBOOK)))


def test_notebook_runs() -> None:
    check(notebook_text(executed_notebook(NOTEBOOK)))
