"""Every ```python block of README.md runs as shown, so the README cannot drift.

Each block runs as its own program: this interpreter, a fresh working directory, its
own ``TMPDIR``, a timeout. It must exit 0 without a traceback, and leave nothing in
its ``TMPDIR`` (the local driver's state lives there until ``stop()``). Every block's
environment points the Modal SDK at the package's local Modal control plane
(``MODAL_SERVER_URL`` and dummy tokens, the ``modal_server`` fixture), so a block on
the Modal driver runs the way a user without a Modal account can run it.

Blocks run without the suite's own environment (``tests/conftest.py`` sets
``HERMES_MODAL_TOOL_REGISTRY_IMAGES=host`` for every other test): what a block needs
beyond a fresh machine is said in the README. A block that cannot run here is marked by
an HTML comment on the line before it, ``<!-- readme-test: compile-only: REASON -->``:
it is compiled, not run, and the reason is required. A block that needs variables is
marked ``<!-- readme-test: env: NAME=value ... -->``: it runs with them, and each
``NAME=value`` must be written in the README's text before the marker (under the same
heading), so a reader sees it before the block. Any other ``readme-test`` marker fails.

Printed output: a comment ``# -> TEXT`` in a block states a line the block prints
(``...`` in TEXT stands for anything). The block's printed lines must contain every
stated line, in the order stated, so the comments cannot drift from what runs.
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


OUTPUT = re.compile(r"#\s*->\s?(.*)$")


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    section: str
    code: str
    marker: str | None  # the readme-test marker's text, if any
    before: str = ""  # the README's text between the heading above and the block

    @property
    def stated_output(self) -> list[str]:
        """The lines its ``# -> TEXT`` comments say it prints, in order."""
        return [m.group(1).rstrip() for m in map(OUTPUT.search, self.code.splitlines()) if m]

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")
        return f"L{self.line}-{slug}"


def python_blocks(text: str) -> list[Block]:
    """The README's fenced Python blocks with the heading above each and its marker."""
    blocks: list[Block] = []
    lines = text.splitlines()
    section, i, started = "top", 0, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            section, started = line.lstrip("#").strip(), i + 1
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
                                marker.group(1) if marker else None, "\n".join(lines[started:i])))
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
    needs = block_env(block, where)
    if block.marker is not None and needs is None:
        compile(block.code, where, "exec")
        return
    script = tmp_path / "block.py"
    script.write_text(block.code)
    work = tmp_path / "cwd"
    work.mkdir()
    # A fresh machine's environment: none of the suite's own settings (conftest.py's
    # HERMES_MODAL_TOOL_REGISTRY_IMAGES=host); the modal_server fixture's MODAL_* stay.
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_MODAL_TOOL_")}
    env.update(needs or {}, TMPDIR=str(block_tmp))
    proc = subprocess.run([sys.executable, str(script)], cwd=work, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    said = f"{where}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, said
    assert "Traceback" not in proc.stderr, said
    assert sorted(os.listdir(block_tmp)) == [], f"left in TMPDIR: {said}"
    missing = unprinted(block.stated_output, proc.stdout.splitlines())
    assert missing is None, f"{where}: '# -> {missing}' is not printed (in that order): {said}"


def block_env(block: Block, where: str) -> dict[str, str] | None:
    """The variables a block's ``env:`` marker gives it (None: no such marker); each must be
    written in the README's text above the block. Fails on an unknown marker."""
    if block.marker is None:
        return None
    kind, _, rest = block.marker.partition(":")
    if kind.strip() == "compile-only":
        assert rest.strip(), f"{where}: 'compile-only' needs a reason"
        return None
    assert kind.strip() == "env" and rest.split(), (
        f"{where}: unknown marker {block.marker!r}; use 'compile-only: REASON' or 'env: NAME=value'")
    pairs = dict(p.split("=", 1) for p in rest.split())
    for name, value in pairs.items():
        assert f"{name}={value}" in block.before, f"{where}: the text above the block must say {name}={value}"
    return pairs


def unprinted(stated: list[str], printed: list[str]) -> str | None:
    """The first stated line (``...``: anything) not found in ``printed`` after the ones
    before it, or None when all are."""
    at = 0
    for text in stated:
        pattern = re.compile(".*".join(map(re.escape, text.split("..."))))
        while at < len(printed) and not pattern.fullmatch(printed[at].rstrip()):
            at += 1
        if at == len(printed):
            return text
        at += 1
    return None


def test_blocks_their_sections_and_markers_are_found() -> None:
    text = ("# Title\n\n```bash\necho no\n```\n\n## Part one\n\n```python\nprint(1)\n```\n\n"
            "<!-- readme-test: compile-only: needs a GPU -->\n\n```py\nimport torch\n```\n"
            "```yaml\na: 1\n```\n")
    found = python_blocks(text)
    assert found[1].before.strip() == "```python\nprint(1)\n```\n\n<!-- readme-test: compile-only: needs a GPU -->"
    assert [(b.line, b.section, b.code, b.marker) for b in found] == [
        (9, "Part one", "print(1)\n", None),
        (15, "Part one", "import torch\n", "compile-only: needs a GPU")]


def test_stated_output_is_checked_in_order() -> None:
    block = Block(1, "s", 'print(1)  # -> 1\nprint("a b")\n# -> a ...\n', None)
    assert block.stated_output == ["1", "a ..."]
    assert unprinted(block.stated_output, ["1", "x", "a b c"]) is None
    assert unprinted(block.stated_output, ["a b", "1"]) == "a ..."  # out of order
    assert unprinted(["/data/slot_0/proj, 42"], ["/workspace/proj", "42"]) == "/data/slot_0/proj, 42"
