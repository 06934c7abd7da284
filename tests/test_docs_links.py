"""The README stays a front page, and the links of the manual lead somewhere.

The README holds what megafixed is, the two commands and a tour; the manual is in docs/. Every relative link in
README.md and docs/*.md must name a file that exists, and a ``#fragment`` must name a heading of that file (as
GitHub spells heading anchors), so moving or renaming a section fails here rather than in a reader's browser."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")
INLINE_CODE = re.compile(r"`[^`]*`")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced blocks, with inline code blanked (a link there is an example, not a link)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append(INLINE_CODE.sub("``", line))
    return out


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens; a link inside the heading counts by its text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if fenced or not heading:
            continue
        base = anchor(heading.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")  # a repeated heading gets -1, -2, ... as on GitHub
    return out


def relative_links(path: Path) -> list[str]:
    return [target for line in prose_lines(path.read_text()) for target in LINK.findall(line)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not checked


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    out = []
    for target in relative_links(path):
        file_part, _, fragment = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path.resolve()
        if not linked.exists():
            out.append(f"{target}: no file {linked.relative_to(root.resolve())}")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            out.append(f"{target}: no heading #{fragment} in {linked.relative_to(root.resolve())}")
    return out


def test_the_readme_is_a_front_page_of_at_most_200_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the manual belongs in docs/"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file_and_heading_that_exist(path):
    assert not broken_links(path), f"{path.relative_to(ROOT)}: " + "; ".join(broken_links(path))


def test_the_readme_links_every_page_of_the_manual():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in relative_links(README)}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs pages the README's tour does not link: {missing}"


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## Exit codes, for every verb\n")
    page.write_text("# Page\n\n[ok](other.md#exit-codes-for-every-verb) [self](#page) `[code](nowhere.md)`\n"
                    "[gone](missing.md) [bad anchor](other.md#exit-codes) [web](https://example.org/x)\n"
                    "```\n[in a block](also-missing.md)\n```\n")
    assert broken_links(page, root=tmp_path) == ["missing.md: no file missing.md",
                                                 "other.md#exit-codes: no heading #exit-codes in other.md"]
    assert anchor("Traffic, the step-time bound, and `--fake` (`parallel/traffic.py`)") == \
        "traffic-the-step-time-bound-and---fake-paralleltrafficpy"
