"""The documentation stays navigable and complete: every relative link in README.md, docs/ and
benchmarks/README.md reaches a file (and a heading, where it names one), every code fence closes, only
benchmarks/README.md gives dates (its figures'), README.md stays short, docs/configuration.md lists every
setting that hvd_notebook.config declares, and every command, subcommand and option of `%hvd`, `%%hvd` and
`hvd-notebook` is named on a page that names its command.

The checkers also run on small synthetic pages, so that they are shown able to fail."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

import pytest

from hvd_notebook import cli
from hvd_notebook.config import ENV_SETTINGS, ClusterOptions
from hvd_notebook.kernel import magics

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md")])
README_MAX_LINES = 200

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
_FENCE_LINE = re.compile(r"^\s*(```|~~~)(.*)$")


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


def unclosed_fences(text: str) -> list[int]:
    """Line numbers of code fences that never close. A closing fence is the opening one's marker alone on its
    line: "``` more text" inside a block does not close it, and the rest of the page renders as code."""
    opened = None
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE_LINE.match(line)
        if match is None:
            continue
        if opened is None:
            opened = (number, match.group(1))
        elif match.group(1) == opened[1] and not match.group(2).strip():
            opened = None
    return [] if opened is None else [opened[0]]


def code_text(text: str) -> str:
    """What a page shows as code: its fenced blocks and its code spans."""
    blocks = [m.group(0) for m in _FENCE.finditer(text)]
    return "\n".join([*blocks, *_CODE_SPAN.findall(_FENCE.sub("", text))])


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [spelling for action in parser._actions if action.help != argparse.SUPPRESS
            and not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
            for spelling in action.option_strings]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def command_surface() -> list[tuple[list[str], list[str]]]:
    """Every command of the two front ends, built from their own parsers (so from ``commands.COMMANDS``): the
    ways a page names it (``hvd-notebook run`` or ``horovodrun``), and its options."""
    surface = []
    for name, parser in _subcommands(cli.build_parser()).items():
        surface.append(([f"hvd-notebook {name}", *(["horovodrun"] if name == "run" else [])], _options(parser)))
    for name, parser in _subcommands(magics._build_line_parser()).items():
        if name != "cell":  # (``%hvd cell`` is the help of %%hvd's options, checked as %%hvd below)
            surface.append(([f"%hvd {name}"], _options(parser)))
    surface.append((["%%hvd"], _options(magics._build_cell_parser())))
    surface.append((["%%hvd sweep"], _options(magics._build_sweep_parser())))
    return surface


def undocumented(surface: list[tuple[list[str], list[str]]], pages: dict[str, str]) -> list[str]:
    """The commands no page names in code, and the options that no page naming their command shows in code."""
    missing = []
    for names, options in surface:
        naming = [code for code in pages.values() if any(re.search(rf"{re.escape(n)}(?![\w-])", code) for n in names)]
        if not naming:
            missing.append(names[0])
            continue
        missing += [f"{names[0]} {option}" for option in options
                    if not any(re.search(rf"(?<![\w%-]){re.escape(option)}(?![\w-])", code) for code in naming)]
    return missing


# ------------------------------------------------------------------ the checkers themselves
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


def test_fence_checker_finds_a_fence_that_never_closes():
    assert unclosed_fences("```python\nx = 1\n```\ntext\n~~~\ny\n~~~\n") == []
    assert unclosed_fences("intro\n```python\nx = 1\n``` Outside a cluster\nmore\n") == [2]
    assert unclosed_fences("```\na\n```\n```bash\nb\n") == [4]


def test_command_checker_finds_a_missing_command_and_option():
    surface = [(["hvd-notebook list"], ["--all"]), (["%hvd debug"], ["--rank"]), (["%hvd pull"], ["--rank"])]
    pages = {"a.md": code_text("Run `hvd-notebook list --all`.\n```\n%hvd debug\n```\nThen `--rank 1`.\n"),
             "b.md": code_text("`%hvd pull x` and, in prose, --rank.\n`%hvd pulled`\n")}
    assert undocumented(surface, pages) == ["%hvd pull --rank"]
    assert undocumented([(["hvd-notebook scaling"], ["-n"])], pages) == ["hvd-notebook scaling"]


# ------------------------------------------------------------------ the real pages
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_fence_closes(page):
    assert unclosed_fences(page.read_text()) == [], f"{page.name}: the code fence opened on this line never closes"


def test_every_command_and_option_is_documented():
    pages = {str(p.relative_to(ROOT)): code_text(p.read_text()) for p in PAGES}
    missing = undocumented(command_surface(), pages)
    assert missing == [], (f"no page shows these in code (`...`), on a page that names their command: {missing}; "
                           "document them (docs/magics.md, docs/installing.md, docs/running-scripts.md ...)")


_DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def dated(text: str) -> list[str]:
    """The dates (YYYY-MM-DD) a page's prose gives; a file name in code, such as a result's, is no date given."""
    return _DATE.findall(_prose(text))


def test_date_finder_skips_code():
    assert dated("Measured 2026-12-04 on the VM.\n`results/2026-12-04-h200.json`\n```\n2026-01-01\n```\n") == [
        "2026-12-04"]


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "README.md" or p.parent == ROOT],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_dated_figures_live_in_benchmarks_readme_only(page):
    assert dated(page.read_text()) == [], (f"{page.name} gives dates: dated figures live in benchmarks/README.md "
                                           "alone; link there instead")


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
