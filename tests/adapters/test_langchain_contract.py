"""``SlotSandbox`` keeps the Deep Agents backend contract where LangChain's standard suite
(langchain-tests 1.1.9) asserts an older one (its ``write`` and ``glob`` tests are
non-strict xfails in test_langchain_sandbox.py, so they hide nothing but also catch
nothing). These tests state the contract as the installed ``deepagents`` defines it
(``deepagents.backends.protocol.BackendProtocol``: ``write`` creates or overwrites;
``glob`` matches a pattern without ``/`` against basenames at any depth, one with ``/``
against the path relative to the search root with ``**``, a leading ``/`` anchors to the
root, leading-dot names only for a pattern segment starting with ``.``, only regular
files, absolute paths; a ``..`` segment is an error) through a real slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from langchain_helpers import portal_backend

ROOT = "/tmp/contract"
FILES = {
    "a.py": "a", "top.txt": "top", "src/app/main.py": "main", "src/app/.hidden.py": "hidden",
    ".github/workflows/ci.yml": "ci", ".env": "env", "dir.py/inner.txt": "inner",
}


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Any]:
    from hermes_modal_tool.adapters.langchain import SlotSandbox

    with portal_backend() as backend:
        box = SlotSandbox(backend, "deepagents-contract")
        try:
            uploaded = box.upload_files([(f"{ROOT}/{p}", c.encode()) for p, c in FILES.items()])
            assert [u.error for u in uploaded] == [None] * len(FILES), uploaded
            yield box
        finally:
            box.close()


def found(box: Any, pattern: str, path: str | None = ROOT) -> set[str]:
    result = box.glob(pattern, path)
    assert result.error is None and result.matches is not None, (pattern, result)
    paths = {m["path"] for m in result.matches}
    assert all(p.startswith("/") for p in paths), paths  # always absolute
    return {p[len(ROOT) + 1:] if p.startswith(ROOT + "/") else p for p in paths}


def test_write_creates_then_overwrites(sandbox: Any) -> None:
    path = f"{ROOT}/new/deeper/w.txt"
    first = sandbox.write(path, "first version\nline 2\n")
    assert first.error is None and first.path == path
    second = sandbox.write(path, "v2")  # shorter: nothing of the first may remain
    assert second.error is None and second.path == path, second
    [got] = sandbox.download_files([path])
    assert got.error is None and got.content == b"v2"
    assert sandbox.execute(f"cat {path}").output == "v2"


def test_edit_replaces_unique_or_all(sandbox: Any) -> None:
    path = f"{ROOT}/edit.txt"
    assert sandbox.write(path, "x = 1\ny = 1\n").error is None
    refused = sandbox.edit(path, "1", "2")  # twice in the file: not unique
    assert refused.error, refused
    assert sandbox.edit(path, "x = 1", "x = 3").error is None
    assert sandbox.edit(path, "1", "9", replace_all=True).error is None
    assert sandbox.download_files([path])[0].content == b"x = 3\ny = 9\n"


def test_glob_basename_patterns_match_at_any_depth(sandbox: Any) -> None:
    assert found(sandbox, "*.py") == {"a.py", "src/app/main.py"}  # no dot-file, no directory
    assert found(sandbox, "*.yml") == {".github/workflows/ci.yml"}
    assert found(sandbox, "?.py") == {"a.py"} and found(sandbox, "[ab].py") == {"a.py"}
    assert found(sandbox, "[!a].py") == set()
    assert found(sandbox, "{a,top}.*") == {"a.py", "top.txt"}
    assert found(sandbox, ".env") == {".env"} and found(sandbox, ".*.py") == {"src/app/.hidden.py"}


def test_glob_path_patterns_are_relative_to_the_root(sandbox: Any) -> None:
    assert found(sandbox, "src/**/*.py") == {"src/app/main.py"}
    assert found(sandbox, "**/*.yml") == set()  # `**` does not enter dot-directories
    assert found(sandbox, "/*.py") == {"a.py"}  # anchored: narrows, never widens
    assert found(sandbox, "*", f"{ROOT}/src/app") == {"src/app/main.py"}
    assert found(sandbox, "dir.py/*") == {"dir.py/inner.txt"}


def test_glob_refuses_dotdot_and_finds_nothing_outside(sandbox: Any) -> None:
    result = sandbox.glob("../*", ROOT)
    assert result.error and result.matches is None, result
    assert found(sandbox, "*.nothing") == set()
