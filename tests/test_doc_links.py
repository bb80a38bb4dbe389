"""Every relative link in the repository's Markdown pages leads somewhere: its file exists and, where it names an
anchor (`page.md#heading`), that page has the heading, with the anchor GitHub makes of it (lower case, punctuation
dropped, spaces as hyphens, `-1`, `-2` for repeats). Links into code blocks and inline code are not links; web
addresses are not followed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The pages: the top-level ones and those of the folders that hold documentation.
PAGE_FOLDERS = ("docs", "benchmarks", "cluster")

_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def pages(root: Path = ROOT) -> list[Path]:
    found = sorted(root.glob("*.md"))
    for folder in PAGE_FOLDERS:
        found += sorted((root / folder).glob("*.md"))
    return found


def prose_lines(text: str, inline_code: bool = False) -> list[str]:
    """The page's lines with fenced code blocks blanked (line numbers kept) and inline code spans removed, unless
    `inline_code` (a heading's anchor is made of its code's text too)."""
    lines, fence = [], None
    for line in text.splitlines():
        opening = _FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
            lines.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            lines.append("")
        else:
            lines.append(line if inline_code else re.sub(r"(`+)(?:(?!\1).)+?\1", "", line))
    return lines


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text: a link's text kept, markup and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading's gets `-1`, `-2`... as on GitHub."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in prose_lines(page.read_text(encoding="utf-8"), inline_code=True):
        match = _HEADING.match(line)
        if not match:
            continue
        anchor = heading_anchor(match.group(2))
        repeats = seen.get(anchor, 0)
        seen[anchor] = repeats + 1
        found.add(anchor if repeats == 0 else f"{anchor}-{repeats}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in the page's prose, inline or as a reference definition."""
    found = []
    for number, line in enumerate(prose_lines(page.read_text(encoding="utf-8")), start=1):
        found += [(number, match.group(1)) for match in _INLINE_LINK.finditer(line)]
        definition = _REFERENCE_DEFINITION.match(line)
        if definition:
            found.append((number, definition.group(1)))
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with each relative link of one page, as `page:line: target: why`."""
    problems = []
    for number, target in links(page):
        if _SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(root)}:{number}: {target}"
        if not destination.exists():
            problems.append(f"{where}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            problems.append(f"{where}: {destination.relative_to(root)} has no heading with the anchor #{anchor}")
    return problems


def test_the_anchors_are_githubs():
    assert heading_anchor("Checking a GPU node: `benchmarks/gpu_smoke.sh`") == "checking-a-gpu-node-benchmarksgpu_smokesh"
    assert heading_anchor("Mixed precision (`training.precision`)") == "mixed-precision-trainingprecision"
    assert heading_anchor("distmis's overhead against a [plain](x.md) script") == "distmiss-overhead-against-a-plain-script"
    assert heading_anchor("Experiment- against data-parallel, at 96^3") == "experiment--against-data-parallel-at-963"


def test_a_broken_file_or_anchor_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Title\n\n## Usage\n\n## Usage\n\n### `dataset.synthetic`\n")
    page = tmp_path / "a.md"
    page.write_text(
        "# A\n\n[fine](docs/b.md#usage) [repeat](docs/b.md#usage-1) [code](docs/b.md#datasetsynthetic) [self](#a)\n"
        "[gone](docs/c.md) [no such heading](docs/b.md#install) [web](https://example.com/x.md)\n"
        "```\n[in a code block](nowhere.md)\n```\n`[inline code](nowhere.md)`\n![image](docs/missing.png)\n"
        "[ref]: docs/b.md#intro\n"
    )
    assert broken_links(page, tmp_path) == [
        "a.md:4: docs/c.md: no such file",
        "a.md:4: docs/b.md#install: docs/b.md has no heading with the anchor #install",
        "a.md:9: docs/missing.png: no such file",
        "a.md:10: docs/b.md#intro: docs/b.md has no heading with the anchor #intro",
    ]


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_pages_include_the_benchmarks_and_their_history():
    assert {ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "history.md"} <= set(pages())
