"""Horovod's own test files, unchanged, against this runtime: each test in its own MPI world.

A measurement, not a test of the suite (Horovod's files live outside this repository):

    .venv/bin/python benchmarks/horovod_suite.py --tests /path/to/horovod [FILE ...] [-k EXPR]
        [--np 2] [--timeout 120] [--out build/horovod-suite/report]

``--tests`` is a Horovod checkout (or a copy of its ``test/`` folder, or of ``test/parallel``); FILE
defaults to ``test_tensorflow.py``. Every test id that ``pytest --collect-only`` lists runs as
``mpiexec -n NP python -m pytest FILE::Class::test`` with ``import horovod.tensorflow`` resolving to this
runtime through the alias the package installs; ``horovod_suite_plugin`` adds the few Horovod test
helpers the files import and writes each rank's outcomes. A test is ``passed`` when every rank passed,
``skipped`` when every rank skipped, ``failed`` when a rank failed, and ``hang`` when the world did not
finish within the timeout or lost a rank before reporting (the whole process group is then killed).
Horovod's TensorFlow tests run each method in graph mode and then eagerly
(``run_all_in_graph_and_eager_modes``): one pytest test, which passes only when both modes do.

Writes ``OUT.json`` (every test, every rank) and ``OUT.md`` (counts per file, then each failing test
with the first line of its error).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PLUGIN = "horovod_suite_plugin"
DEPENDENCIES = ("parameterized", "mock")  # third-party modules Horovod's test files import
OUTCOMES = ("passed", "failed", "skipped", "hang")
TOKEN_VARIABLE = "HVD_SUITE_RUN"
OUTPUT_TAIL_CHARS = 4000
FAILED_GRACE_S = 15.0  # how long the other ranks get to finish once one rank has failed


@dataclass
class Result:
    """One test's outcome over all ranks."""

    nodeid: str
    outcome: str  # one of OUTCOMES
    seconds: float
    message: str = ""  # the first error line (or skip reason) of the first rank that has one
    mode: str = ""  # for a failure of a graph-and-eager test: the mode that failed first
    ranks: dict[str, list[dict]] = field(default_factory=dict)  # rank -> its phase records
    output_tail: str = ""  # the end of the world's output, for a test that failed or hung


def test_dir(tests: Path) -> Path:
    """The folder holding Horovod's ``test_*.py`` files, from a checkout, its test/ or test/parallel."""
    for candidate in (tests / "test" / "parallel", tests / "parallel", tests):
        if (candidate / "base_test_tensorflow.py").exists() or list(candidate.glob("test_tensorflow*.py")):
            return candidate.resolve()
    raise SystemExit(f"no Horovod test files under {tests} (expected test/parallel/test_tensorflow.py)")


def dependency_path(tests: Path, python: str) -> str | None:
    """A folder with the third-party test dependencies the venv lacks, installed there once."""
    missing = [m for m in DEPENDENCIES
               if subprocess.run([python, "-c", f"import {m}"], capture_output=True).returncode != 0]
    if not missing:
        return None
    target = tests / ".horovod-suite-deps"
    if any(not (target / m).exists() for m in missing):
        print(f"installing {', '.join(missing)} (Horovod's test dependencies) into {target}", flush=True)
        subprocess.run([python, "-m", "pip", "install", "--quiet", "--target", str(target), *missing], check=True)
    return str(target)


def environment(tests: Path, python: str) -> dict[str, str]:
    """The ranks' environment: the plugin and Horovod's test/utils on the path, CPU only."""
    paths = [str(tests.parent / "utils"), str(tests)]  # before HERE: Horovod's utils/common.py is not ours
    deps = dependency_path(tests, python)
    paths += [deps, str(HERE)] if deps else [str(HERE)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "HVD_NOTEBOOK_GPUS": "", "CUDA_VISIBLE_DEVICES": "",
            "TF_CPP_MIN_LOG_LEVEL": "2"}


def pytest_args(extra: list[str]) -> list[str]:
    return ["-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", "-q", "--no-header", "-o", "addopts=",
            "--rootdir", ".", *extra]


def collect(tests: Path, file: str, python: str, env: dict[str, str], keyword: str | None) -> list[str]:
    """The test ids of ``file``, as pytest lists them."""
    args = [python, *pytest_args(["--collect-only", file] + (["-k", keyword] if keyword else []))]
    proc = subprocess.run(args, cwd=tests, env=env, capture_output=True, text=True, timeout=600)
    ids = [line.strip() for line in proc.stdout.splitlines() if line.startswith(f"{file}::")]
    if proc.returncode not in (0, 5):
        raise SystemExit(f"collecting {file} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return ids


def processes_with_token(token: str) -> list[psutil.Process]:
    """Live processes whose environment carries this run's token (the ranks mpiexec started)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(TOKEN_VARIABLE) == token:
                found.append(p)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return found


def stop_world(proc: subprocess.Popen, token: str) -> None:
    """Kill the world's process group, then any rank that left it; wait until all are gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for _ in range(50):
        left = processes_with_token(token)
        if not left:
            return
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.1)
    raise RuntimeError(f"processes of test world {token} outlived SIGKILL: {[p.pid for p in left]}")


def read_ranks(directory: Path, ranks: int) -> dict[str, list[dict]]:
    out = {}
    for r in range(ranks):
        path = directory / f"rank-{r}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        out[str(r)] = [json.loads(line) for line in lines if line.endswith("}")]  # not one being written
    return out


def failed_mode(longrepr: str) -> str:
    """Which mode of ``run_all_in_graph_and_eager_modes`` a failure came from (graph runs first)."""
    if "run_eagerly(self" in longrepr or "in run_eagerly" in longrepr:
        return "eager"
    if "in decorated" in longrepr:
        return "graph"
    return ""


def classify(nodeid: str, ranks: dict[str, list[dict]], timed_out: bool, seconds: float) -> Result:
    """One outcome from every rank's phase records."""
    result = Result(nodeid, "passed", round(seconds, 1), ranks=ranks)
    phases = [rec for recs in ranks.values() for rec in recs if rec["nodeid"] == nodeid]
    failures = [rec for rec in phases if rec["outcome"] == "failed"]
    complete = all(any(rec["when"] == "teardown" for rec in recs if rec["nodeid"] == nodeid)
                   for recs in ranks.values())
    if failures:
        result.outcome, result.message = "failed", failures[0].get("message", "")
        result.mode = failed_mode(failures[0].get("longrepr", ""))
    elif timed_out or not complete:
        result.outcome = "hang"
        result.message = "timed out" if timed_out else "a rank exited without reporting (lost world)"
    elif all(any(rec["outcome"] == "skipped" for rec in recs if rec["nodeid"] == nodeid) for recs in ranks.values()):
        skip = next(rec for rec in phases if rec["outcome"] == "skipped")
        result.outcome, result.message = "skipped", skip.get("message", "")
    if timed_out and result.outcome == "failed" and not complete:
        result.message += " (the other rank(s) then hung)"
    return result


def wait_world(proc: subprocess.Popen, directory: Path, args: argparse.Namespace) -> bool:
    """Wait for the world to end; True when it did not. A rank that failed leaves the others waiting in
    a collective for ever: once one rank has finished with a failure, the rest get ``FAILED_GRACE_S``."""
    deadline = time.monotonic() + args.timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            return True
        if deadline - time.monotonic() > FAILED_GRACE_S and finished_with_failure(directory, args.np):
            deadline = time.monotonic() + FAILED_GRACE_S
        time.sleep(0.25)
    return False


def finished_with_failure(directory: Path, ranks: int) -> bool:
    """Has some rank reported a failure and finished its test (its teardown)?"""
    for recs in read_ranks(directory, ranks).values():
        if any(r["outcome"] == "failed" for r in recs) and any(r["when"] == "teardown" for r in recs):
            return True
    return False


def run_test(tests: Path, nodeid: str, args: argparse.Namespace, env: dict[str, str]) -> Result:
    """``nodeid`` in its own world of ``args.np`` ranks."""
    with tempfile.TemporaryDirectory(prefix="hvd-suite-") as tmp:
        token = uuid.uuid4().hex
        rank_env = {**env, "HVD_SUITE_REPORT_DIR": tmp, TOKEN_VARIABLE: token}
        cmd = [args.mpiexec, "-n", str(args.np), args.python, *pytest_args(["-x", "-p", "no:timeout", nodeid])]
        start = time.monotonic()
        with open(Path(tmp) / "output.txt", "w") as output:
            proc = subprocess.Popen(cmd, cwd=tests, env=rank_env, stdout=output, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            timed_out = wait_world(proc, Path(tmp), args)
            stop_world(proc, token)
        result = classify(nodeid, read_ranks(Path(tmp), args.np), timed_out, time.monotonic() - start)
        if result.outcome in ("hang", "failed"):
            result.output_tail = (Path(tmp) / "output.txt").read_text(errors="replace")[-OUTPUT_TAIL_CHARS:]
        return result


def markdown(results: dict[str, list[Result]], meta: dict) -> str:
    """Counts per file, then every test that did not pass or skip, with its first error line."""
    lines = [f"# Horovod's tests against hvd_notebook ({meta['date']})", "",
             f"Horovod {meta['horovod']}; {meta['np']} ranks; {meta['machine']}; per-test timeout {meta['timeout']} s.",
             f"Command: `{meta['command']}`", "",
             "A test that skips here (GPU tests on a CPU) does not apply; the others ran.", "",
             "| file | tests | skipped | ran | passed | failed | hang |", "|---|---|---|---|---|---|---|"]
    for file, rs in results.items():
        c = Counter(r.outcome for r in rs)
        lines.append(f"| {file} | {len(rs)} | {c['skipped']} | {len(rs) - c['skipped']} | {c['passed']} "
                     f"| {c['failed']} | {c['hang']} |")
    for file, rs in results.items():
        bad = [r for r in rs if r.outcome in ("failed", "hang")]
        if bad:
            lines += ["", f"## {file}: not passed", "", "| test | outcome | mode | first error line |",
                      "|---|---|---|---|"]
            for r in bad:
                msg = r.message.replace("|", "\\|").replace("\n", " ")[:300]
                lines.append(f"| `{r.nodeid.split('::')[-1]}` | {r.outcome} | {r.mode} | {msg} |")
    return "\n".join(lines) + "\n"


def earlier_skips(report: Path | None, file: str) -> dict[str, str]:
    """Test id -> skip reason, for the tests of ``file`` that skipped in an earlier report."""
    if report is None:
        return {}
    results = json.loads(report.read_text())["results"].get(file, [])
    return {r["nodeid"]: r["message"] for r in results if r["outcome"] == "skipped"}


def horovod_version(tests: Path) -> str:
    """``SOURCE`` beside the tests (what the copy was taken from), else the checkout's commit."""
    for parent in (tests, *tests.parents):
        if (parent / "SOURCE").exists():
            return (parent / "SOURCE").read_text().strip()
    proc = subprocess.run(["git", "-C", str(tests), "describe", "--tags", "--always"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", default=["test_tensorflow.py"], help="test files (default: test_tensorflow.py)")
    p.add_argument("--tests", type=Path, required=True, help="a Horovod checkout, its test/ or test/parallel")
    p.add_argument("-k", dest="keyword", help="pytest -k expression selecting tests")
    p.add_argument("--np", type=int, default=2, help="ranks per world (default 2)")
    p.add_argument("--timeout", type=float, default=120, help="seconds per test world (default 120)")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "horovod-suite" / "report",
                   help="writes OUT.json and OUT.md (default build/horovod-suite/report)")
    p.add_argument("--skip-skipped", type=Path, metavar="REPORT.json",
                   help="tests that skipped in that earlier report count as skipped without running again")
    p.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    p.add_argument("--mpiexec", default=None, help="default: the mpiexec beside --python")
    args = p.parse_args(argv)
    args.python = str(Path(args.python).absolute())  # the ranks run in the tests' folder
    args.mpiexec = args.mpiexec or str(Path(args.python).parent / "mpiexec")
    return args


def write_reports(out: Path, results: dict[str, list[Result]], meta: dict) -> None:
    """``OUT.json`` and ``OUT.md`` (rewritten after every test, so a long run can be read as it goes)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    counts = {f: dict(Counter(r.outcome for r in rs)) for f, rs in results.items()}
    out.with_suffix(".json").write_text(json.dumps(
        {**meta, "counts": counts, "results": {f: [asdict(r) for r in rs] for f, rs in results.items()}}, indent=1))
    out.with_suffix(".md").write_text(markdown(results, meta))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tests = test_dir(args.tests)
    env = environment(tests, args.python)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "horovod": horovod_version(tests),
            "np": args.np, "timeout": args.timeout, "machine": f"{os.cpu_count()} CPUs, {sys.platform}",
            "command": " ".join(["benchmarks/horovod_suite.py", *(argv if argv is not None else sys.argv[1:])])}
    results: dict[str, list[Result]] = {}
    for file in args.files:
        ids = collect(tests, file, args.python, env, args.keyword)
        print(f"{file}: {len(ids)} tests", flush=True)
        results[file] = []
        skipped_before = earlier_skips(args.skip_skipped, file)
        for i, nodeid in enumerate(ids, 1):
            if nodeid in skipped_before:
                r = Result(nodeid, "skipped", 0.0, message=f"skipped in {args.skip_skipped.name}: "
                                                           f"{skipped_before[nodeid]}")
            else:
                r = run_test(tests, nodeid, args, env)
            results[file].append(r)
            write_reports(args.out, results, meta)
            print(f"[{i}/{len(ids)}] {r.outcome:7} {r.seconds:6.1f}s {nodeid.split('::')[-1]}"
                  + (f"  {r.mode} {r.message[:150]}" if r.outcome in ("failed", "hang") else ""), flush=True)
    write_reports(args.out, results, meta)
    print(markdown(results, meta).split("\n\n## ")[0])
    print(f"written: {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
