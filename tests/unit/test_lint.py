"""The code passes ruff with the settings in pyproject.toml; test modules have names of their own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_is_clean():
    # no .ruff_cache in the clone: it may belong to another user (scripts/test-unprivileged.sh)
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_two_test_modules_share_a_basename():
    # the test folders are not packages: one pytest run cannot import two modules of one name. make test's run
    # collects unit and integration; tests/parallel is collected apart, inside its mpiexec worlds
    for run in (("unit", "integration"), ("parallel",)):
        seen: dict[str, list[str]] = {}
        for path in sorted(p for folder in run for p in (ROOT / "tests" / folder).rglob("test_*.py")):
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
        shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
        assert not shared, f"rename one of each: {shared}"


def test_the_unprivileged_part_names_tests_that_exist():
    # a renamed test file would leave scripts/test-unprivileged.sh collecting nothing, failing only in make test
    script = ROOT / "scripts" / "test-unprivileged.sh"
    expand = f'eval "$(sed -n "/^TESTS=(/,/^)/p" {script})"; printf "%s\\n" "${{TESTS[@]}}"'
    listed = subprocess.run(["bash", "-c", expand], capture_output=True, text=True, timeout=30,
                            check=True).stdout.split()
    assert len(listed) > 5, listed
    missing = [test for test in listed if not (ROOT / test.split("::")[0]).is_file()]
    assert not missing, f"scripts/test-unprivileged.sh names tests that are not there: {missing}"
