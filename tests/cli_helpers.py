"""What the command line tests share: running the CLI in-process and writing batch files."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from hermes_modal_tool import cli


def run(*args: str):
    """``hermes-modal-tool ARGS`` in this process (click's runner); its ``Result``."""
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


def write_jsonl(path: Path, rows: list) -> Path:
    """Write ``rows`` (objects, or lines as they are) as a JSONL batch file."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def bash(command: str, **expect):
    """A batch file's bash call, with ``expect`` checks when given."""
    call = {"tool": "bash", "args": {"command": command}}
    if expect:
        call["expect"] = expect
    return call
