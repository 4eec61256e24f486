"""The documentation stays navigable and complete: every relative link in README.md, docs/ and
benchmarks/README.md reaches a file (and a heading, where it names one), README.md stays short, and
docs/configuration.md lists every setting that hvd_notebook.config declares.

The link checker also runs on small synthetic pages, so that it is shown able to fail."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from hvd_notebook.config import ENV_SETTINGS, ClusterOptions

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md")])
README_MAX_LINES = 200

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The page without fenced code blocks and code spans, where link syntax means nothing."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page; repeated headings get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(page: Path) -> list[str]:
    """Relative links of ``page`` whose file does not exist, or whose ``#anchor`` names no heading."""
    broken = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            broken.append(f"{target}: {linked.name} has no heading with anchor #{anchor}")
    return broken


# ------------------------------------------------------------------ the checker itself
def test_slugs_follow_github():
    assert slug("The device check: `gpu_check.sh`") == "the-device-check-gpu_checksh"
    assert slug("`%hvd start` options") == "hvd-start-options"
    assert slug("Keras 3 training") == "keras-3-training"


def test_repeated_headings_get_numbered_anchors():
    assert anchors("# A\n## B\n## B\n```\n# not a heading\n```\n") == {"a", "b", "b-1"}


def test_link_checker_finds_missing_files_and_anchors(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n## Part two\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok too](other.md#part-two) [self](#here) [web](https://example.org/x)\n"
        "[gone](missing.md) [bad anchor](other.md#part-three) ![img](img/none.png)\n"
        "`[in code](nowhere.md)`\n```\n[in a block](nowhere.md)\n```\n## Here\n"
    )
    found = broken_links(page)
    assert len(found) == 3, found
    assert any(b.startswith("missing.md") for b in found)
    assert any(b.startswith("other.md#part-three") for b in found)
    assert any(b.startswith("img/none.png") for b in found)


# ------------------------------------------------------------------ the real pages
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_docs_pages_exist():
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    for topic in ("magics", "dashboard", "runtime", "gpus", "hosts-and-slurm", "sharing", "configuration",
                  "troubleshooting", "architecture", "testing"):
        assert f"{topic}.md" in names


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_configuration_page_lists_every_setting():
    page = (ROOT / "docs" / "configuration.md").read_text()
    missing = [s.name for s in ENV_SETTINGS if f"`{s.name}`" not in page]
    for f in fields(ClusterOptions):
        missing += [flag for flag in f.metadata["flags"] if not re.search(rf"`{re.escape(flag)}\b", page)]
    assert missing == [], f"docs/configuration.md does not mention {missing}"


def test_architecture_page_names_every_module():
    page = (ROOT / "docs" / "architecture.md").read_text()
    package = ROOT / "hvd_notebook"
    missing = [str(p.relative_to(package)) for p in sorted(package.rglob("*.py"))
               if p.name != "__init__.py" and f"{p.name}`" not in page]
    missing += [f"{d.relative_to(package)}/" for d in sorted(package.rglob("*"))
                if (d / "__init__.py").exists() and f"{d.name}/`" not in page]
    assert missing == [], f"docs/architecture.md does not name {missing}"
