"""The documentation site (mkdocs.yml, docs/) builds with ``mkdocs build --strict``: a broken
link, a README section that is gone or an API reference that names nothing fails the suite.

Its prose is the README's and SECURITY.md's own sections, included by scripts/docs_hooks.py
(so the README-block test covers its code too); the API reference is mkdocstrings' reading of
the public modules' docstrings.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
assert spec and spec.loader
hooks = importlib.util.module_from_spec(spec)
sys.modules["docs_hooks"] = hooks  # its dataclasses look their module up
spec.loader.exec_module(hooks)


def test_the_site_builds_strictly_with_the_readme_and_the_api(tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    page = (site / "guide" / "configuration" / "index.html").read_text()
    assert "slots_per_sandbox" in page and "min_pool" in page  # the README's table, included
    assert 'href="../images/#images-on-the-local-driver"' in page  # an anchor on another page
    assert "Threat model" in (site / "security" / "index.html").read_text()  # SECURITY.md
    api = (site / "reference" / "backend" / "index.html").read_text()
    assert "execute_batch" in api and "acquire" in api  # generated from the docstrings
    assert "SandboxToolkit" in (site / "reference" / "adapters" / "index.html").read_text()


def site_of(pages: dict[str, str]) -> object:
    site = hooks.Site()
    for name, text in pages.items():
        site.add_page(name, text)
    return site


def test_a_section_is_its_heading_to_the_next_of_its_level() -> None:
    text = "# T\nintro\n## A\na\n```\n# not a heading\n```\n### A1\na1\n## B\nb\n"
    assert hooks.section(text, hooks.Include("R", "A"), "w") == "## A\na\n```\n# not a heading\n```\n### A1\na1\n"
    assert hooks.section(text, hooks.Include("R", "T", intro=True), "w") == "# T\nintro\n"
    with pytest.raises(hooks.IncludeError, match="0 headings 'C'"):
        hooks.section(text, hooks.Include("R", "C"), "w")


def test_links_go_to_the_page_that_includes_their_target() -> None:
    site = site_of({"guide/config.md": '<!-- include: README.md "Configuration reference" -->',
                    "security.md": "<!-- include: SECURITY.md -->"})
    out = site.links("[a](#configuration-reference) [b](SECURITY.md) [c](benchmarks/README.md)",
                     "README.md", "guide/other.md", "w")
    assert out == "[a](../guide/config.md#configuration-reference) [b](../security.md) c (`benchmarks/README.md`)"
    with pytest.raises(hooks.IncludeError, match="#no-such-section"):
        site.links("[x](#no-such-section)", "README.md", "index.md", "w")
    with pytest.raises(hooks.IncludeError, match="no such file"):
        site.links("[x](notebooks/gone.ipynb)", "README.md", "index.md", "w")
    with pytest.raises(hooks.IncludeError, match="0 headings"):
        site_of({"x.md": '<!-- include: README.md "No such heading" -->'})


def test_the_pages_code_is_the_readmes() -> None:
    """The pages hold no code blocks of their own: their examples are the README's, which
    tests/test_readme.py runs, included by the hook."""
    pages = sorted((ROOT / "docs").rglob("*.md"))
    assert len(pages) >= 10 and any("<!-- include: README.md" in p.read_text() for p in pages)
    own = [str(p.relative_to(ROOT)) for p in pages if "```" in p.read_text()]
    assert own == [], f"code blocks in docs pages (put them in the README and include it): {own}"
