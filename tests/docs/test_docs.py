"""The README and the pages under docs/: short README, links that resolve, no commit hashes in
user-facing pages, and the quick-start commands the README shows are ones ``dev`` has.

Only docs/journal/ (the dated diary) and dated reports (a file name with a YYYY-MM-DD date) may cite
commits. A link to docs/flags.md resolves only once that generated page exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
DATED = re.compile(r"\d{4}-\d{2}-\d{2}")
USER_FACING = [p for p in PAGES if not DATED.search(p.name)]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\]\n]|\n(?!\n))*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
# a 7-40 digit hex word with at least one digit and one of a-f, not part of a longer word or id
COMMIT = re.compile(r"(?<![\w-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")


def _prose(text: str) -> str:
    """The text outside fenced code blocks, for headings (a ``# comment`` in a shell block is none)."""
    return FENCE.sub("", text)


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for match in HEADING.finditer(_prose(path.read_text())):
        slug = github_anchor(match.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[str]:
    text = INLINE_CODE.sub("", FENCE.sub("", path.read_text()))
    return [m.group(1) for m in LINK.finditer(text)]


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(path: Path) -> list[str]:
    """Each relative link in ``path`` whose file, or whose anchor in that file, does not exist."""
    broken = []
    for target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part).resolve()
        if not dest.exists():
            broken.append(f"{target}: no file {_shown(dest)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {_shown(dest)}")
    return broken


def test_readme_is_at_most_250_lines():
    assert len(README.read_text().splitlines()) <= 250


def test_profile_page_is_short_and_the_journal_is_kept():
    assert len((ROOT / "docs" / "profile.md").read_text().splitlines()) <= 120
    assert (ROOT / "docs" / "journal" / "profile-journal.md").is_file()
    assert "journal/profile-journal.md" in (ROOT / "docs" / "profile.md").read_text()


def test_github_anchor_rules():
    assert github_anchor("Tensor parallelism: `-tp`") == "tensor-parallelism--tp"
    assert github_anchor("Rate sweep: the paper's Fig. 12 on our engine") == "rate-sweep-the-papers-fig-12-on-our-engine"
    assert github_anchor("2026-12-04, seventeenth session: the suite's workers") == (
        "2026-12-04-seventeenth-session-the-suites-workers")
    assert github_anchor("snake_case and CAPS") == "snake_case-and-caps"


def test_link_extraction_skips_code_and_finds_images(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Top\n\n[a](x.md) ![b](y.png) `[c](z.md)`\n\n```\n[d](w.md)\n# not a heading\n```\n"
                    "[e](#top) [f](#not-a-heading) [g](https://example.com/x)\n")
    assert links(page) == ["x.md", "y.png", "#top", "#not-a-heading", "https://example.com/x"]
    assert anchors(page) == {"top"}
    assert [b.split(":")[0] for b in broken_links(page)] == ["x.md", "y.png", "#not-a-heading"]
    (tmp_path / "x.md").write_text("## Has it\n")
    page.write_text("[a](x.md#has-it) [b](x.md#lacks-it)\n")
    assert broken_links(page) == [f"x.md#lacks-it: no heading with anchor #lacks-it in {tmp_path / 'x.md'}"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    """Every relative link (and anchor) in the README and docs/*.md lands on a file (and heading)."""
    assert broken_links(page) == []


@pytest.mark.parametrize("page", USER_FACING, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_commit_hashes_in_user_facing_pages(page):
    assert COMMIT.findall(page.read_text()) == []


def test_commit_pattern_finds_hashes_and_spares_words():
    journal = (ROOT / "docs" / "journal" / "profile-journal.md").read_text()
    assert len(COMMIT.findall(journal)) > 10  # the diary cites commits: the pattern sees them
    assert COMMIT.findall("main at `f33d7fd`, then 4fb2191.") == ["f33d7fd", "4fb2191"]
    assert COMMIT.findall("deadbeef 1234567 0x1f2e3d4c psv-abc1234 chatcmpl-tool-9f8e7d6c #1f77b4") == []


def test_no_work_log_prose_in_user_facing_pages():
    for page in USER_FACING:
        text = LINK.sub("", page.read_text())  # link targets may name a journal entry
        assert not re.search(r"\bthis session\b|\bwe (then )?tried\b", text, re.I), page.name


def _fenced_blocks(text: str) -> list[str]:
    return [m.group(0).split("\n", 1)[1].rsplit("\n", 1)[0].strip() for m in FENCE.finditer(text)]


def test_quick_start_commands_are_the_dev_cases():
    text = README.read_text()
    quick_start = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = _fenced_blocks(quick_start)
    assert "./dev serve" in blocks and "./dev test" in blocks
    dev = (ROOT / "dev").read_text()
    cases = re.findall(r"^\s*([a-z]+)\)", dev, re.M)
    assert "serve" in cases and "test" in cases


STALE_CITATION = re.compile(r"docs/profile\.md\W{0,4}\s*(?:\d{4}-\d{2}-\d{2},\s*)?[a-z-]+(?: and [a-z-]+)? sessions?\b")


def test_code_comments_cite_the_journal_for_sessions():
    """A citation of a dated session ("docs/profile.md, seventeenth session") points at the journal,
    not at the short profile page, which has no sessions."""
    assert STALE_CITATION.search("kept both busy (docs/profile.md, seventeenth\n    # session). Each".replace(
        "\n    # ", " "))
    assert STALE_CITATION.search("``docs/profile.md``, ninth and tenth sessions")
    assert not STALE_CITATION.search("``docs/journal/profile-journal.md``, twenty-third session")
    stale = []
    for path in [ROOT / "dev", *ROOT.glob("*.yaml"), *ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"),
                 *(p for d in ("services", "shared", "kernels", "loadtest", "tests", "deploy")
                   for p in (ROOT / d).rglob("*.py"))]:
        if path == Path(__file__).resolve():  # the examples above
            continue
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text())  # a citation may wrap a comment line
        stale += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in STALE_CITATION.finditer(text)]
    assert stale == []
