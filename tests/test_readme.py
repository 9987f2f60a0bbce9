"""Every ```python block of README.md runs as shown, so the README cannot drift.

Each block runs as its own program: this interpreter, a fresh working directory, its
own ``TMPDIR``, a timeout. It must exit 0 without a traceback, and leave nothing in
its ``TMPDIR`` (the local driver's state lives there until ``stop()``). Every block's
environment points the Modal SDK at the package's local Modal control plane
(``MODAL_SERVER_URL`` and dummy tokens, the ``modal_server`` fixture), so a block on
the Modal driver runs the way a user without a Modal account can run it.

A block that cannot run here is marked by an HTML comment on the line before it,
``<!-- readme-test: compile-only: REASON -->``: it is compiled, not run, and the
reason is required. Any other ``readme-test`` marker fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```\s*(\S*)")
MARKER = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->$")
PYTHON = {"python", "py", "python3"}
TIMEOUT_S = 240


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    section: str
    code: str
    marker: str | None  # the readme-test marker's text, if any

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")
        return f"L{self.line}-{slug}"


def python_blocks(text: str) -> list[Block]:
    """The README's fenced Python blocks with the heading above each and its marker."""
    blocks: list[Block] = []
    lines = text.splitlines()
    section, i = "top", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        fence = FENCE.match(line)
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"README.md:{i + 1}: a code block is never closed"
        if fence.group(1).lower() in PYTHON:
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = MARKER.match(before)
            blocks.append(Block(i + 1, section, "\n".join(lines[i + 1:end]) + "\n",
                                marker.group(1) if marker else None))
        i = end + 1
    return blocks


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_the_readme_has_python_blocks_to_run() -> None:
    assert len(BLOCKS) >= 5, [b.id for b in BLOCKS]  # the extraction found the README's examples
    assert len({b.id for b in BLOCKS}) == len(BLOCKS)


@pytest.fixture
def block_tmp() -> Path:
    """A TMPDIR for one block, reachable by slot uids (pytest's tmp_path is 0700)."""
    tmp = Path(tempfile.mkdtemp(prefix="hmt-readme-"))
    tmp.chmod(0o711)
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_python_block_runs_as_shown(block: Block, modal_server, block_tmp: Path,
                                          tmp_path: Path) -> None:
    where = f"README.md:{block.line} ({block.section})"
    if block.marker is not None:
        kind, _, reason = block.marker.partition(":")
        assert kind.strip() == "compile-only" and reason.strip(), (
            f"{where}: unknown marker {block.marker!r}; use 'compile-only: REASON'")
        compile(block.code, where, "exec")
        return
    script = tmp_path / "block.py"
    script.write_text(block.code)
    work = tmp_path / "cwd"
    work.mkdir()
    env = {**os.environ, "TMPDIR": str(block_tmp)}  # with the modal_server fixture's MODAL_*
    proc = subprocess.run([sys.executable, str(script)], cwd=work, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    said = f"{where}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, said
    assert "Traceback" not in proc.stderr, said
    assert sorted(os.listdir(block_tmp)) == [], f"left in TMPDIR: {said}"


def test_blocks_their_sections_and_markers_are_found() -> None:
    text = ("# Title\n\n```bash\necho no\n```\n\n## Part one\n\n```python\nprint(1)\n```\n\n"
            "<!-- readme-test: compile-only: needs a GPU -->\n\n```py\nimport torch\n```\n"
            "```yaml\na: 1\n```\n")
    found = python_blocks(text)
    assert [(b.line, b.section, b.code, b.marker) for b in found] == [
        (9, "Part one", "print(1)\n", None),
        (15, "Part one", "import torch\n", "compile-only: needs a GPU")]
