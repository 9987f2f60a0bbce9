"""MkDocs hook (mkdocs.yml ``hooks:``): the documentation site's pages include the README's
and SECURITY.md's sections, so the prose has one source and the site cannot drift from it.

A page says what it includes with an HTML comment on a line of its own:

    <!-- include: README.md "Configuration reference" -->        the section: its heading, its
                                                                  text and its subsections
    <!-- include: README.md "hermes-modal-tool" intro -->        the heading's own text only,
                                                                  up to its first subsection
    <!-- include: SECURITY.md -->                                 the whole file

Links in an included text are rewritten for the site: ``#anchor`` goes to the page that
includes the section with that anchor, a link to an included whole file (``SECURITY.md``)
goes to its page, and any other relative link (``notebooks/x.ipynb``) must name a file of
the repository and becomes the path as code. A heading, an anchor or a file that does not
exist raises :class:`IncludeError`, so ``mkdocs build`` fails on it (``--strict`` besides
fails on a page's own broken links and on mkdocstrings' unresolved references).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r'^<!--\s*include:\s*(?P<file>\S+)(?:\s+"(?P<heading>[^"]+)"(?P<intro>\s+intro)?)?\s*-->\s*$',
                    re.M)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


class IncludeError(Exception):
    """An include marker or a link in an included text that names nothing."""


@dataclass(frozen=True)
class Include:
    file: str  # relative to the repository root
    heading: str | None  # None: the whole file
    intro: bool = False


def headings(lines: list[str]) -> list[tuple[int, int, str]]:
    """(line index, level, text) of every Markdown heading outside fenced code."""
    found, fenced = [], False
    for i, line in enumerate(lines):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            found.append((i, len(m.group(1)), m.group(2)))
    return found


def section(text: str, inc: Include, where: str) -> str:
    """The part of ``text`` that ``inc`` names (see the module's docstring)."""
    if inc.heading is None:
        return text
    lines = text.splitlines()
    heads = headings(lines)
    at = [k for k, (_, _, title) in enumerate(heads) if title == inc.heading]
    if len(at) != 1:
        raise IncludeError(f"{where}: {inc.file} has {len(at)} headings {inc.heading!r} "
                           f"(want exactly one; its headings: {[h[2] for h in heads]})")
    k = at[0]
    start, level = heads[k][0], heads[k][1]
    ends = (i for i, lvl, _ in heads[k + 1:] if inc.intro or lvl <= level)
    return "\n".join(lines[start:next(ends, len(lines))]).rstrip() + "\n"


def includes_of(markdown: str) -> list[tuple[re.Match[str], Include]]:
    return [(m, Include(m["file"], m["heading"], bool(m["intro"]))) for m in MARKER.finditer(markdown)]


class Site:
    """Which page includes which file and which anchors, to rewrite links between them."""

    def __init__(self) -> None:
        self.whole: dict[str, str] = {}  # included whole file -> page (src path)
        self.anchors: dict[str, str] = {}  # anchor of an included heading -> page

    def add_page(self, page: str, markdown: str) -> None:
        for m, inc in includes_of(markdown):
            text = section(read(inc.file, f"{page}: {m.group(0)}"), inc, f"{page}: {m.group(0)}")
            if inc.heading is None:
                self.whole[inc.file] = page
            for _, _, title in headings(text.splitlines()):
                self.anchors.setdefault(slugify(title, "-"), page)

    def expand(self, page: str, markdown: str) -> str:
        """``markdown`` with its markers replaced by the texts they name, links rewritten."""
        def one(m: re.Match[str]) -> str:
            inc = Include(m["file"], m["heading"], bool(m["intro"]))
            where = f"{page}: {m.group(0)}"
            return self.links(section(read(inc.file, where), inc, where), inc.file, page, where)
        return MARKER.sub(one, markdown)

    def links(self, text: str, source: str, page: str, where: str) -> str:
        base = (ROOT / source).parent

        def one(m: re.Match[str]) -> str:
            bang, label, target = m.groups()
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                return m.group(0)
            path, _, anchor = target.partition("#")
            if not path:
                if anchor not in self.anchors:
                    raise IncludeError(f"{where}: link to #{anchor}: no included heading has it")
                return f"[{label}]({rel(self.anchors[anchor], page)}#{anchor})"
            full = (base / path).resolve()
            name = full.relative_to(ROOT).as_posix() if full.is_relative_to(ROOT) else path
            if not full.exists():
                raise IncludeError(f"{where}: link to {target!r}: no such file in the repository")
            if name in self.whole and not bang:
                return f"[{label}]({rel(self.whole[name], page)}{'#' + anchor if anchor else ''})"
            return f"{label} (`{name}`)"
        return LINK.sub(one, text)


def read(name: str, where: str) -> str:
    path = ROOT / name
    if not path.is_file():
        raise IncludeError(f"{where}: no file {name} in the repository")
    return path.read_text(encoding="utf-8")


def rel(target_page: str, page: str) -> str:
    """The link from ``page`` to ``target_page`` (both relative to docs/), as MkDocs wants."""
    if target_page == page:
        return ""
    up = "../" * page.count("/")
    return up + target_page


# The MkDocs events (https://www.mkdocs.org/user-guide/configuration/#hooks).
_site = Site()


def on_files(files, config):  # noqa: ANN001, ANN201
    global _site
    _site = Site()
    for f in files.documentation_pages():
        _site.add_page(f.src_uri, Path(f.abs_src_path).read_text(encoding="utf-8"))
    return files


def on_page_markdown(markdown, page, config, files):  # noqa: ANN001, ANN201
    return _site.expand(page.file.src_uri, markdown)
