"""The docs hold together: every relative link in README.md and docs/*.md reaches a file,
every ``#anchor`` a heading of its target, and the README stays a short front page.

Markdown is parsed with markdown-it-py (CommonMark + tables), so links inside code spans
and fenced blocks are not links. Anchors follow GitHub's heading slugs: the heading's text
lowercased, every character other than a letter, digit, ``_``, ``-`` or space dropped,
spaces turned into ``-``; a repeated slug gets ``-1``, ``-2``, ... in order.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 170
_PARSER = MarkdownIt("commonmark").enable("table")


def slug(text: str) -> str:
    """GitHub's anchor of a heading whose rendered text is ``text``."""
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def _plain(inline) -> str:
    """The rendered text of an inline token: text and code spans, without link targets."""
    return "".join(c.content for c in inline.children or [] if c.type in ("text", "code_inline"))


def anchors(path: Path) -> set[str]:
    """Every heading anchor of the markdown file ``path``."""
    tokens, seen, found = _PARSER.parse(path.read_text(encoding="utf-8")), {}, set()
    for i, token in enumerate(tokens):
        if token.type == "heading_open":
            base = slug(_plain(tokens[i + 1]))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """``(line, target)`` of every link and image in ``path`` (1-based line of its block)."""
    out = []
    for token in _PARSER.parse(path.read_text(encoding="utf-8")):
        for child in token.children or []:
            target = child.attrs.get("href") if child.type == "link_open" else child.attrs.get("src")
            if child.type in ("link_open", "image") and target:
                out.append((token.map[0] + 1 if token.map else 0, str(target)))
    return out


def broken_links(path: Path) -> list[str]:
    """One line per relative link of ``path`` whose file or ``#anchor`` does not exist."""
    errors = []
    for line, target in links(path):
        parts = urlsplit(target)
        if parts.scheme or parts.netloc:  # https:, mailto:, ...: not checked (no network)
            continue
        where = f"{'docs/' if path.parent.name == 'docs' else ''}{path.name}:{line}"
        dest = (path.parent / unquote(parts.path)).resolve() if parts.path else path
        if not dest.exists():
            errors.append(f"{where}: link '{target}': no file {dest}")
        elif parts.fragment and (dest.suffix != ".md" or unquote(parts.fragment) not in anchors(dest)):
            errors.append(f"{where}: link '{target}': no heading '#{parts.fragment}' in {dest.name}")
    return errors


def test_slugs_follow_githubs_rule():
    # by hand: lowercase; drop ( ) ` / . , = ; spaces -> '-' (a dropped '=' between spaces leaves '--')
    assert slug("The search (compiler/search.py, compiler/cost.py)") == "the-search-compilersearchpy-compilercostpy"
    assert slug("Bad inputs get one line, exit 2") == "bad-inputs-get-one-line-exit-2"
    assert slug("k = 0 asynchronous is the synchronous baseline, bit for bit") == \
        "k--0-asynchronous-is-the-synchronous-baseline-bit-for-bit"
    assert slug("Placing nodes: the allocation_mode key") == "placing-nodes-the-allocation_mode-key"


def test_the_checker_finds_a_missing_file_a_missing_heading_and_skips_code(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "A.md").write_text("# A\n\n## Two words\n\n## Two words\n")
    page = docs / "B.md"
    page.write_text(
        "# B\n\n"
        "[ok](A.md) [ok](A.md#two-words) [ok](A.md#two-words-1) [ok](#b) [web](https://example.com/x.md)\n\n"
        "[gone](C.md)\n\n"
        "[no heading](A.md#three-words)\n\n"
        "`[in code](D.md)`\n\n```\n[fenced](E.md)\n```\n"
    )
    assert broken_links(page) == [
        f"docs/B.md:5: link 'C.md': no file {docs / 'C.md'}",
        "docs/B.md:7: link 'A.md#three-words': no heading '#three-words' in A.md",
    ]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_relative_link_reaches_a_file_and_heading(path):
    errors = broken_links(path)
    assert not errors, "\n".join(errors)


def test_readme_is_a_short_front_page_with_the_two_commands():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the front page keeps <= {README_MAX_LINES}"
    stripped = {line.strip() for line in lines}
    assert "make run" in stripped and "make test" in stripped  # .ci/run calls `make test`
