"""The README fits on a few screens and every link in it and in docs/ leads somewhere.

A link to a file must name a file of the repository; a link with an anchor (``page.md#section``) must
name a heading of that page, as GitHub spells its anchors (lower case, punctuation dropped, spaces as
hyphens, a repeated heading numbered).
"""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.foundation

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [m.group(1) for m in LINK.finditer(text)]


def test_readme_fits_in_250_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move the depth to docs/"


def test_every_readme_section_the_issue_names_is_there():
    headings = {h for h in anchors(ROOT / "README.md")}
    for needed in ("two-commands-a-fresh-linux-machine-with-python-310-and-make", "what-it-saves", "nodes",
                   "example-workflows", "turning-the-shared-tiers-on", "troubleshooting", "compatibility",
                   "documentation"):
        assert needed in headings, needed


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_resolves(page):
    checked = 0
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not followed here (no network)
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link to {target!r}: no such file"
        assert ROOT in dest.parents or dest == ROOT, f"{page.name}: {target!r} leaves the repository"
        if anchor:
            assert dest.suffix == ".md", f"{page.name}: anchor into a non-page {target!r}"
            assert anchor in anchors(dest), f"{page.name}: {target!r}: {dest.name} has no heading {anchor!r}"
        checked += 1
    if page.name == "README.md":
        assert checked >= 10  # the docs pages, the panel picture, the per-layer details
