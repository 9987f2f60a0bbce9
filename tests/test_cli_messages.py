"""What the command line prints besides results: warnings, missing extras, progress in logs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from hermes_modal_tool.cli._live_progress import PLAIN_EVERY_S, LiveLines
from hermes_modal_tool.slots import OutputEvent

CLI = Path(sys.executable).with_name("hermes-modal-tool")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("TERMINAL_", "ATROPOS_", "PYTHONWARN"))}


def test_a_config_warning_is_one_line_of_the_clis_own(tmp_path: Path) -> None:
    """Two profiles, none named default: the warning that the first is picked comes as
    ``warning: ...`` on one line, not Python's ``file.py:N: ConfigWarning:`` and source line."""
    path = tmp_path / "p.yaml"
    path.write_text("profiles:\n  alpha: {}\n  beta: {}\n")
    proc = subprocess.run([str(CLI), "profiles", "check", str(path)], env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines == [f"warning: {path}: no profile 'default' and no default_profile given; using "
                     "'alpha' (the first profile) when a call names none"], proc.stderr
    assert "alpha" in proc.stdout  # the table still comes


def test_a_missing_extra_names_the_package_and_the_checkouts_command() -> None:
    """``mcp`` without the mcp package: the message gives both install commands."""
    code = ("import sys; sys.modules['mcp'] = None\n"
            "from hermes_modal_tool.cli import main\n"
            "main(['mcp'])")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "the mcp extra is not installed" in proc.stderr
    assert "pip install 'hermes-modal-tool[mcp]'" in proc.stderr and "pip install -e '.[mcp]'" in proc.stderr


def test_progress_lines_in_a_log_are_few_whatever_the_trajectories_print() -> None:
    """Not on a terminal, 64 trajectories each printing test failures they expect give one
    line per PLAIN_EVERY_S in all, not one (or two) per trajectory."""
    console = Console(file=open(os.devnull, "w"), record=True, width=120)  # noqa: SIM115
    live = LiveLines(console, plain=True)
    for i in range(64):
        live.watch(f"traj-{i}")(OutputEvent(i, f"s{i}", "stdout", "FAILED (failures=1)\nmore\n"))
    printed = console.export_text().splitlines()
    assert printed == ["[traj-0] more"], printed  # the first line shows; the rest wait
    assert PLAIN_EVERY_S >= 5
