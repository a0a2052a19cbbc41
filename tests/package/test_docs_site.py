"""The documentation site as a reader sees it: examples shown as code, every public name in the
API reference, the home page leading to the headline callbacks."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.docs_site import (
    ROOT,
    Docstrings,
    ProseExample,
    build_site,
    page_objects,
    prose_examples,
)

import lightning_recorder

#: Public subpackages whose ``__all__`` the API reference covers, besides the package's own.
SUBPACKAGES = (
    "activations",
    "bulk",
    "callbacks",
    "distill",
    "errors",
    "graph",
    "inspector",
    "recorders",
    "stats",
)

#: Source files whose docstrings are being rewritten elsewhere and still use ``Example:``;
#: ``test_pending_docstrings_render_as_code`` fails as soon as they are fixed, to retire this.


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's documentation site, built with ``mkdocs build --strict``."""
    site_dir = tmp_path_factory.mktemp("site")
    build_site(ROOT / "mkdocs.yml", site_dir)
    return site_dir


@pytest.fixture(scope="module")
def problems(site: Path) -> list[tuple[ProseExample, str]]:
    """Every docstring example line shown as prose, and the file of its docstring."""
    docstrings = Docstrings()
    found = []
    for page in sorted(site.rglob("*.html")):
        html = page.read_text(encoding="utf-8")
        rendered = docstrings.of_page(html)
        for problem in prose_examples(html, rendered, str(page.relative_to(site))):
            source = docstrings.filepath(problem.object).relative_to(ROOT).as_posix()
            found.append((problem, source))
    return found


def test_api_pages_render_examples_as_code(site: Path, problems: list[Any]) -> None:
    pages = [p for p in site.rglob("*.html") if page_objects(p.read_text(encoding="utf-8"))]
    assert len(pages) >= 12  # the API reference and the guides that show API entries
    wrong = [f"{problem} ({source})" for problem, source in problems]
    assert not wrong, "docstring examples rendered as prose (write `Examples:`):\n" + "\n".join(
        wrong
    )


def _resolve(dotted: str) -> Any:
    """The object a heading id names (``package.module.Name.member``), imported."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def _api_entries(site: Path) -> dict[str, list[Any]]:
    """The objects the API reference documents, by their short name."""
    entries: dict[str, list[Any]] = {}
    for page in sorted((site / "api").rglob("*.html")):
        for dotted in page_objects(page.read_text(encoding="utf-8")):
            entries.setdefault(dotted.rsplit(".", 1)[-1], []).append(_resolve(dotted))
    return entries


def test_every_public_name_has_an_api_entry(site: Path) -> None:
    entries = _api_entries(site)
    missing = []
    for owner in ["", *SUBPACKAGES]:
        module = importlib.import_module(f"lightning_recorder.{owner}".rstrip("."))
        for name in module.__all__:
            if name == "__version__":
                continue
            value = getattr(module, name)
            if not any(value is entry for entry in entries.get(name, [])):
                missing.append(f"{module.__name__}.{name}")
    assert not missing, f"public names without an entry in docs/api/: {missing}"
    index = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert "__version__" in index
    assert len(lightning_recorder.__all__) > 60  # the check saw the real list


def test_home_page_links_the_headline_callbacks(site: Path) -> None:
    html = (site / "index.html").read_text(encoding="utf-8")
    for page in ("feature_stats_monitor/", "distillation/", "tensorboard/", "api/"):
        assert f'href="{page}' in html, page


# -- the check itself, on a page rendered from docstrings written to fail it -----------------

BAD_AND_GOOD = '''
"""Docstrings for the documentation check."""


def singular(x: int) -> int:
    """Add one.

    Example:
        >>> model = singular(1)
        >>> model.__init__(x)
        >>> singular(1)
        2
    """
    return x + 1


def plural(x: int) -> int:
    """Add two.

    Examples:
        >>> plural(1)
        3
    """
    return x + 2


def bare(x: int) -> int:
    """Add three, an example in no section.

    >>> bare(1)
    4
    """
    return x + 3
'''


def test_check_fails_on_an_example_rendered_as_prose(tmp_path: Path) -> None:
    # The project's own mkdocs settings (theme, Markdown extensions, mkdocstrings options).
    project = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    config = {key: project[key] for key in ("theme", "markdown_extensions", "plugins")}
    config.update(site_name="check", nav=["index.md"])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(
        "# Check\n\n::: doc_check_fixture.singular\n\n::: doc_check_fixture.plural\n\n"
        "::: doc_check_fixture.bare\n",
        encoding="utf-8",
    )
    (tmp_path / "doc_check_fixture.py").write_text(BAD_AND_GOOD, encoding="utf-8")
    build_site(tmp_path / "mkdocs.yml", tmp_path / "site")  # strict: mkdocs sees no problem

    html = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    docstrings = Docstrings([tmp_path]).of_page(html)
    assert set(docstrings) == {f"doc_check_fixture.{n}" for n in ("singular", "plural", "bare")}
    found = {(p.object.rsplit(".", 1)[-1], p.line) for p in prose_examples(html, docstrings)}
    assert found == {
        ("singular", ">>> model = singular(1)"),
        ("singular", ">>> model.__init__(x)"),
        ("singular", ">>> singular(1)"),
        ("bare", ">>> bare(1)"),
    }


def _page(*objects: tuple[str, str]) -> str:
    """A page in mkdocstrings' layout: one ``div.doc-object`` per ``(id, contents)``."""
    return "\n".join(
        f'<div class="doc doc-object doc-function"><h2 id="{name}" class="doc doc-heading">'
        f'{name}</h2><div class="doc doc-contents">{contents}</div></div>'
        for name, contents in objects
    )


def test_check_reads_each_object_in_its_own_part_of_the_page() -> None:
    code = (
        '<div class="highlight"><pre><span></span><code><span class="gp">&gt;&gt;&gt; </span>'
        "f(1)\n2</code></pre></div>"
    )
    prose = "<blockquote><blockquote><blockquote><p>f(1)\n2</p></blockquote></blockquote>"
    prose += "</blockquote>"
    docstrings = {"m.f": "Examples:\n    >>> f(1)\n    2\n", "m.g": "Example:\n    >>> f(1)\n"}
    assert list(prose_examples(_page(("m.f", code)), docstrings)) == []
    # Prose in one object's docstring is not excused by another object's code block.
    got = [
        (p.object, p.problem)
        for p in prose_examples(_page(("m.f", code), ("m.g", prose)), docstrings)
    ]
    assert got == [("m.g", "is in no code block")]
    # Shown as code and as prose (a paragraph repeating it): still a problem.
    got = [(p.object, p.problem) for p in prose_examples(_page(("m.f", code + prose)), docstrings)]
    assert got == [("m.f", "is in a paragraph")]
    # Inline code inside a paragraph is prose about code, not an example rendered as prose.
    inline = "<p>Call <code>f(1)</code>.</p>"
    assert list(prose_examples(_page(("m.f", code + inline)), docstrings)) == []
    with pytest.raises(KeyError):
        list(prose_examples(_page(("m.h", code)), docstrings))
