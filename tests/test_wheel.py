"""The package as a user installs it: the built wheel in a fresh virtual environment.

The rest of the suite runs from the editable install, which finds every module in the
source tree whether or not the wheel carries it (``hermes_modal_tool.images`` was once
left out of the wheel, and from it no sandbox could start). Here ``python -m build``
makes the sdist and, from that sdist, the wheel; the wheel goes into a new venv with no
source tree on its path, and the CLI and a backend round trip run from there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment of a new shell: none of this suite's settings, no PYTHONPATH."""
    keep = ("PATH", "HOME", "LANG", "TMPDIR", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL",
            "PIP_FIND_LINKS", "PIP_CONFIG_FILE", "PIP_CACHE_DIR")
    return {**{k: os.environ[k] for k in keep if k in os.environ}, **extra}


def _run(argv: list[str], cwd: Path, timeout: float = 240, **kw) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                            timeout=timeout, **kw)
    assert result.returncode == 0, f"{argv} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)], cwd=out, timeout=300)
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


@pytest.fixture(scope="module")
def venv(dist: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("fresh")
    env_dir = home / "venv"
    # No pip of its own (ensurepip took 20-45 s here): this suite's pip installs into it
    # (``pip --python``), the wheel and the dependencies it declares, nothing else.
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], cwd=home)
    _run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install", "--quiet",
          "--disable-pip-version-check", "-c", str(ROOT / "scripts" / "constraints.txt"),
          str(dist["wheel"])], cwd=home, timeout=300)
    return env_dir


def _package_dirs() -> set[str]:
    """Every folder of the source tree that holds modules, by its installed package name."""
    found = set()
    for top, name in ((ROOT / "hermes_modal_tool", "hermes_modal_tool"),
                      (ROOT / "adapters", "hermes_modal_tool/adapters")):
        for path in top.rglob("*.py"):
            if "__pycache__" not in path.parts:
                found.add(str(Path(name) / path.parent.relative_to(top)).replace("/.", ""))
    return found


def test_the_wheel_carries_every_package_and_the_type_marker(dist: dict[str, Path]) -> None:
    with zipfile.ZipFile(dist["wheel"]) as whl:
        names = set(whl.namelist())
    packages = {str(Path(n).parent) for n in names if n.endswith(".py")}
    missing = _package_dirs() - packages
    assert not missing, f"folders with modules that the wheel leaves out: {sorted(missing)}"
    assert "hermes_modal_tool/images/unpack.py" in names
    assert "hermes_modal_tool/py.typed" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    with zipfile.ZipFile(dist["wheel"]) as whl:
        assert "hermes-modal-tool = hermes_modal_tool.cli:main" in whl.read(entry).decode()


def test_the_sdist_carries_what_the_tests_and_the_main_job_need(dist: dict[str, Path]) -> None:
    with tarfile.open(dist["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ("setup.py", "pyproject.toml", "README.md", "tests/conftest.py", "tests/support.py",
                   "examples/coding_rollouts.jsonl", "scripts/constraints.txt", "scripts/setup.sh",
                   "hermes_modal_tool/images/unpack.py", "adapters/langchain.py"):
        assert needed in names, f"the sdist has no {needed}"
    assert not any("__pycache__" in n for n in names)


def test_the_installed_cli_runs_a_command_and_a_batch(venv: Path, tmp_path: Path) -> None:
    cli = str(venv / "bin" / "hermes-modal-tool")
    assert _run([cli, "--help"], cwd=tmp_path).stdout.count("exec") >= 1
    result = _run([cli, "exec", "--", "echo", "ok"], cwd=tmp_path)
    assert result.stdout.strip().splitlines()[-1] == "ok"
    batch = tmp_path / "two.jsonl"
    batch.write_text("".join(json.dumps(row) + "\n" for row in (
        {"id": "a", "calls": [{"tool": "bash", "args": {"command": "echo from-a > f && cat f"},
                               "expect": {"returncode": 0, "output_contains": "from-a"}}]},
        {"id": "b", "calls": [{"tool": "bash", "args": {"command": "cat f"},
                               "expect": {"returncode": 1}}]})))
    _run([cli, "batch", str(batch), "-o", str(tmp_path / "out.jsonl")], cwd=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(r["id"], r["ok"]) for r in rows] == [("a", True), ("b", True)]


ROUND_TRIP = """
import asyncio, hermes_modal_tool
from hermes_modal_tool import SandboxConfig, ToolBackend

async def main():
    backend = ToolBackend(SandboxConfig(slots_per_sandbox=2, min_sandboxes=1, max_sandboxes=1))
    await backend.start()
    try:
        slot = await backend.acquire("t1")
        (r,) = await backend.execute_batch([(slot, "bash", {"command": "echo round-trip $((6*7))"})])
        await backend.release(slot)
    finally:
        await backend.stop()
    print(hermes_modal_tool.__file__)
    print(r.success, r.metadata["returncode"], r.output.strip())

asyncio.run(main())
"""


def test_a_backend_round_trip_from_the_installed_package(venv: Path, tmp_path: Path) -> None:
    result = _run([str(venv / "bin" / "python"), "-c", ROUND_TRIP], cwd=tmp_path)
    where, line = result.stdout.strip().splitlines()[-2:]
    assert where.startswith(str(venv)), f"imported from {where}, not the fresh venv"
    assert line == "True 0 round-trip 42"
