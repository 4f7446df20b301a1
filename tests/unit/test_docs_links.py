"""The README is a front page (at most 250 lines) and every documentation page is reachable from it;
every relative link in the README and under docs/ points at a file that exists and, with an
#anchor, at a heading of that file (GitHub's anchor rules)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to -; repeats get -1, -2."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", FENCE.sub("", page.read_text()), re.M):
        text = re.sub(r"`([^`]*)`", r"\1", heading)  # code marks are not in the anchor; the code's own _ stay
        text = re.sub(r"\*{1,2}(.+?)\*{1,2}|(?<!\w)_{1,2}(.+?)_{1,2}(?!\w)", lambda m: m[1] or m[2], text)  # emphasis
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(FENCE.sub("", page.read_text())) if not re.match(r"[a-z]+:", t)]


def test_the_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to a page under docs/"
    text = README.read_text()
    assert "make demo" in text and "make test" in text


def test_every_docs_page_is_reachable_from_the_readme():
    reached, todo = set(), [README]
    while todo:
        page = todo.pop()
        for target in _links(page):
            path = (page.parent / target.split("#")[0]).resolve() if target.split("#")[0] else page
            if path.suffix == ".md" and path.exists() and path not in reached:
                reached.add(path)
                todo.append(path)
    assert not [p.name for p in PAGES if p.resolve() not in reached]
    direct = {(ROOT / t.split("#")[0]).resolve() for t in _links(README)}
    assert [p.name for p in PAGES if p.resolve() not in direct] == []  # each one a line of the README's list


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in [README, *PAGES]:
        for target in _links(page):
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {path.name})")
    assert broken == []


def test_the_checker_sees_a_broken_link_and_a_broken_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A `code` heading\n\n## Twice\n\n## Twice\n\n[ok](#a-code-heading) [ok](#twice-1) [bad](#nope) [gone](missing.md)\n"
                    "```\n[not a link](inside-a-fence.md)\n```\n")  # fmt: skip
    assert _anchors(page) == {"a-code-heading", "twice", "twice-1"}
    assert _links(page) == ["#a-code-heading", "#twice-1", "#nope", "missing.md"]
