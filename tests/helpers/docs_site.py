"""The built documentation site: build it, and check that docstring examples render as code.

mkdocstrings' Google parser turns an ``Examples:`` section into code blocks; an ``Example:``
(singular) section, or an example outside any section, is rendered as Markdown, where ``>>>``
becomes nested block quotes and the code one paragraph of prose. ``mkdocs build --strict`` does
not notice, so :func:`prose_examples` reads the generated HTML: every ``>>>``/``...`` line of the
docstring of every object rendered on a page must appear in a ``<pre>`` block of that page, and
never in a paragraph.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: A doctest line: its prompt and its code.
_PROMPT = re.compile(r"^\s*(>>>|\.\.\.)(?: (.*))?$")
#: A doctest directive at the end of a line (``# doctest: +ELLIPSIS``), which mkdocstrings
#: leaves out of the rendered code (its ``trim_doctest_flags`` option, on by default).
_DIRECTIVE = re.compile(r"\s*#\s*doctest:.*$")


def build_site(config: Path, site_dir: Path, cwd: Path | None = None) -> None:
    """``mkdocs build --strict`` of ``config`` into ``site_dir``; raise with mkdocs' output."""
    env = {
        **os.environ,
        "NO_MKDOCS_2_WARNING": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(cwd or config.parent), str(ROOT), os.environ.get("PYTHONPATH", "")]
        ),
    }
    command = ["mkdocs", "build", "--strict", "-q", "-f", str(config), "-d", str(site_dir)]
    proc = subprocess.run(
        [sys.executable, "-m", *command],
        cwd=cwd or config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise AssertionError(f"mkdocs build failed:\n{proc.stdout[-5000:]}{proc.stderr[-5000:]}")


class _Page(HTMLParser):
    """One HTML page: for each object mkdocstrings rendered (a ``div.doc-object`` with a heading
    id), the text of the ``<pre>`` blocks and of the ``<p>`` paragraphs (inline ``<code>`` left
    out) of its own docstring, its members' left out."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.pre: dict[int, list[str]] = {}
        self.paragraphs: dict[int, list[str]] = {}
        self.ids: dict[int, str] = {}
        self._divs: list[int | None] = []  # each open <div>: its object's number, if one
        self._count = 0
        self._pre_depth = 0
        self._p_depth = 0
        self._code_in_p = 0

    @property
    def _object(self) -> int:
        return next((n for n in reversed(self._divs) if n is not None), -1)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if tag == "div":
            self._count += "doc-object" in classes
            self._divs.append(self._count if "doc-object" in classes else None)
        elif tag == "pre":
            if self._pre_depth == 0:
                self.pre.setdefault(self._object, []).append("")
            self._pre_depth += 1
        elif tag == "p" and self._pre_depth == 0:
            self.paragraphs.setdefault(self._object, []).append("")
            self._p_depth += 1
        elif tag == "code" and self._p_depth:
            self._code_in_p += 1
        elif re.fullmatch(r"h[1-6]", tag) and "doc-heading" in classes:
            self.ids.setdefault(self._object, dict(attrs).get("id") or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "div" and self._divs:
            self._divs.pop()
        elif tag == "pre" and self._pre_depth:
            self._pre_depth -= 1
        elif tag == "p" and self._p_depth:
            self._p_depth -= 1
        elif tag == "code" and self._code_in_p:
            self._code_in_p -= 1

    def handle_data(self, data: str) -> None:
        if self._pre_depth:
            self.pre[self._object][-1] += data
        elif self._p_depth and not self._code_in_p:
            self.paragraphs[self._object][-1] += data


@dataclass(frozen=True)
class ProseExample:
    """A docstring example line that a page does not show as code."""

    page: str
    object: str
    line: str
    problem: str

    def __str__(self) -> str:
        return f"{self.page}: {self.object}: {self.line!r} {self.problem}"


def _lines(texts: Iterable[str]) -> set[str]:
    return {" ".join(line.split()) for text in texts for line in text.splitlines()}


def example_lines(docstring: str) -> list[tuple[str, str]]:
    """``(line, code)`` of each doctest line of ``docstring`` with code in it (prompt included
    in ``line``, whitespace collapsed)."""
    found = []
    for raw in docstring.splitlines():
        match = _PROMPT.match(raw)
        if match and _DIRECTIVE.sub("", match[2] or "").strip():
            code = " ".join(_DIRECTIVE.sub("", match[2]).split())
            found.append((f"{match[1]} {code}", code))
    return found


def page_objects(html: str) -> list[str]:
    """The ids of the objects mkdocstrings rendered on a page (``package.module.Name``...)."""
    page = _Page()
    page.feed(html)
    return [name for name in page.ids.values() if name]


def prose_examples(
    html: str, docstrings: dict[str, str], page: str = "page"
) -> Iterator[ProseExample]:
    """The docstring example lines of the objects rendered on a page that are not code there.

    Each object's example lines are looked for in its own part of the page (its docstring,
    without its members'): in a ``<pre>`` block, and in no paragraph.

    Args:
        html: the generated page.
        docstrings: the raw docstring of each object id the page renders (see
            :class:`Docstrings`).
        page: the page's name, for the report.
    """
    parsed = _Page()
    parsed.feed(html)
    for number, name in parsed.ids.items():
        code = _lines(parsed.pre.get(number, []))
        prose = _lines(parsed.paragraphs.get(number, []))
        for line, source in example_lines(docstrings[name]):
            if line not in code:
                yield ProseExample(page, name, line, "is in no code block")
            elif line in prose or source in prose:
                yield ProseExample(page, name, line, "is in a paragraph")


class Docstrings:
    """The raw docstrings of rendered objects, by id, as griffe (mkdocstrings' loader) reads
    them; members inherited from a base class included, as mkdocstrings shows them."""

    def __init__(self, search_paths: Iterable[Path] = (ROOT,)) -> None:
        import griffe

        self._loader = griffe.GriffeLoader(search_paths=[str(p) for p in search_paths])

    def _get(self, name: str) -> Any:
        package, *parts = name.split(".")
        modules = self._loader.modules_collection
        if package not in modules:
            self._loader.load(package)
        obj = modules[package]
        for part in parts:
            members = obj.all_members if obj.is_class else obj.members
            obj = members[part]
        return obj

    def __call__(self, name: str) -> str:
        """The docstring of the object ``name`` (``""`` if it has none).

        Raises:
            KeyError: no such object.
        """
        obj = self._get(name)
        return obj.docstring.value if obj.docstring is not None else ""

    def filepath(self, name: str) -> Path:
        """The source file of the object ``name`` (of its target, for an imported name)."""
        obj = self._get(name)
        path = obj.filepath
        return Path(path[0] if isinstance(path, list) else path)

    def of_page(self, html: str) -> dict[str, str]:
        """The docstrings of the objects rendered on a page."""
        return {name: self(name) for name in page_objects(html)}
