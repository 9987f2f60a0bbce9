"""notebooks/mcp_server.ipynb runs top to bottom and is committed with its outputs."""

from __future__ import annotations

from pathlib import Path

from support import (
    assert_outputs_current,
    committed_notebook,
    executed_notebook,
    notebook_text,
)

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "mcp_server.ipynb"


def check(text: str) -> None:
    assert "bash: ['background', 'command', 'stdin', 'timeout']" in text
    assert "list_files: ['max_entries', 'path', 'recursive']" in text
    assert "/proj\n[exit code 0]" in text  # `cd proj` and `export` stuck between calls
    assert "42\n[exit code 0]" in text
    assert "[exit code 124: command timed out" in text
    assert "structured: {'exit_code': 124, 'timed_out': True, 'truncated': False}" in text
    assert "(tool error) Error: no such file" in text
    assert "server exit code: 0" in text
    alice = next(line for line in text.splitlines() if line.startswith("alice: "))
    bob = next(line for line in text.splitlines() if line.startswith("bob: "))
    assert "'alice.txt'" in alice and "'bob.txt'" in bob  # each sees only its own files
    assert alice.split("'")[1] != bob.split("'")[1]  # two sessions, two slots


def test_notebook_is_committed_with_outputs() -> None:
    check(notebook_text(committed_notebook(NOTEBOOK)))


def test_notebook_runs() -> None:
    nb = executed_notebook(NOTEBOOK)
    check(notebook_text(nb))
    assert_outputs_current(committed_notebook(NOTEBOOK), nb)
