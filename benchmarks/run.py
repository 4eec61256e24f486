"""Run hvd_notebook's benchmarks and print each as a table of ratios to its baseline.

Why: hvd_notebook is a thin layer over ipyparallel + MPI; its value is lost if
that layer makes starting a cluster or running a cell noticeably slower than
plain ipyparallel doing the same work. Each benchmark measures both side by
side in one run and checks the ratio against a target.

    .venv/bin/python benchmarks/run.py              # every benchmark (what `make bench` runs)
    .venv/bin/python benchmarks/run.py cluster      # only those whose name contains "cluster"
    .venv/bin/python benchmarks/run.py --quick      # short smoke run, rough figures
    .venv/bin/python benchmarks/run.py --smoke      # the test suite's run: each harness once, figures meaningless
    .venv/bin/python benchmarks/run.py --list
    .venv/bin/python benchmarks/run.py gpu          # on an NVIDIA GPU only: not among "every benchmark"

Each benchmark's figures also go to build/bench/<name>.json. The exit status is
0 when every benchmark ran, whether or not its targets were met (this is a
report), and 1 when a benchmark crashed.

To add a benchmark: write a function ``(Context) -> Report`` in a module of
this folder and append a ``Benchmark`` for it to ``BENCHMARKS``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_allreduce  # noqa: E402
import bench_cluster  # noqa: E402
import bench_elastic  # noqa: E402
import bench_gpu  # noqa: E402
import bench_keras  # noqa: E402
import bench_noise_scale  # noqa: E402
import bench_panel  # noqa: E402
import bench_progress  # noqa: E402
import bench_soak  # noqa: E402
import bench_torch  # noqa: E402
from common import Context, Report  # noqa: E402

OUT_DIR = Path(__file__).resolve().parent.parent / "build" / "bench"


@dataclass(frozen=True)
class Benchmark:
    name: str
    description: str
    run: Callable[[Context], Report]
    by_default: bool = True  # False: runs only when named (it needs hardware the usual machine lacks)


BENCHMARKS: list[Benchmark] = [
    Benchmark(
        "cluster",
        "%hvd start -n 2 and empty %%hvd cells vs plain ipyparallel (+ TF import) and %%px",
        bench_cluster.run,
    ),
    Benchmark(
        "allreduce",
        "hvd.allreduce / grouped_allreduce vs raw mpi4py Allreduce, check and timeline costs",
        bench_allreduce.run,
    ),
    Benchmark(
        "keras",
        "DistributedOptimizer: 1 -> 2 ranks scaling efficiency, wrapper cost on one rank",
        bench_keras.run,
    ),
    Benchmark(
        "noise_scale",
        "a 2-rank training step with the gradient noise scale measured vs not, Keras and PyTorch",
        bench_noise_scale.run,
    ),
    Benchmark(
        "progress",
        "the same 2-rank fit with the live dashboard on and with --no-progress",
        bench_progress.run,
    ),
    Benchmark(
        "panel",
        "the same 2-rank fit while the JupyterLab panel reads the cluster every 1.5 s and while nothing reads it",
        bench_panel.run,
    ),
    Benchmark(
        "elastic",
        "hvd.elastic: a commit of 25 M parameters (+ Adam) vs 0.2 s; the step after a commit vs one without",
        bench_elastic.run,
    ),
    Benchmark(
        "torch",
        "PyTorch: hvd.allreduce vs raw MPI, DistributedOptimizer vs DDP, overlap of communication with backward",
        bench_torch.run,
    ),
    Benchmark(
        "soak",
        "faults and restarts, warm standby off and on: recovery times (restart <= 3 s, elastic <= 5 s) and leaks",
        bench_soak.run,
    ),
    Benchmark(
        "gpu",
        "one GPU, the reduction forced: hvd vs raw dist.all_reduce, cupy NCCL and DDP (needs a GPU and PyTorch)",
        bench_gpu.run,
        by_default=False,
    ),
]


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def format_report(report: Report) -> str:
    header = ("measure", report.ours_label, report.baseline_label, "ratio", "target", "result")
    rows = [header] + [
        (
            f"{r.measure} [{r.unit}]",
            _fmt(r.ours),
            _fmt(r.baseline),
            "-" if r.skipped else f"{r.ratio:.2f}x",
            "-" if r.target is None else f"<= {r.target:g}x",
            f"skipped: {r.skipped}" if r.skipped else r.verdict,
        )
        for r in report.rows
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    out = [f"== {report.name}: {report.title}", *lines]
    out += [f"  * {note}" for note in report.notes]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run only benchmarks whose name contains one of these")
    parser.add_argument("--quick", action="store_true", help="short smoke run; figures are rough")
    parser.add_argument("--smoke", action="store_true",
                        help="the test suite's run (implies --quick): each harness and its rows, figures meaningless")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)

    if args.list:
        for b in BENCHMARKS:
            print(f"{b.name:12} {b.description}")
        return 0
    chosen = [b for b in BENCHMARKS if (any(n in b.name for n in args.names) if args.names else b.by_default)]
    if not chosen:
        parser.error(f"no benchmark matches {args.names}; see --list")

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    ctx = Context(quick=args.quick or args.smoke, smoke=args.smoke)
    if args.smoke:  # (for the workers under mpiexec, which are given --quick: mpi_allreduce_worker.py reads it)
        os.environ["HVD_BENCH_SMOKE"] = "1"
    crashed: list[str] = []
    try:
        _run_each(chosen, ctx, crashed)
    finally:
        bench_progress.release(kept_only=True)  # (a cluster that --smoke kept for a benchmark that did not run)

    if crashed:
        print(f"\ncrashed: {', '.join(crashed)}")
        return 1
    return 0


def _run_each(chosen: list[Benchmark], ctx: Context, crashed: list[str]) -> None:
    """Run each chosen benchmark, print its table and write its figures; a crash is printed and named in
    ``crashed``, and the others still run."""
    for bench in chosen:
        if bench.name != "panel":  # (the one benchmark that takes the progress benchmark's cluster --smoke keeps)
            bench_progress.release(kept_only=True)
        print(f"-- running {bench.name}: {bench.description}", flush=True)
        t0 = time.perf_counter()
        try:
            report = bench.run(ctx)
        except Exception:
            traceback.print_exc()
            print(f"!! benchmark {bench.name} crashed", flush=True)
            crashed.append(bench.name)
            continue
        elapsed = time.perf_counter() - t0
        report.data.setdefault("elapsed_s", round(elapsed, 2))
        report.data.setdefault("quick", ctx.quick)
        report.data.setdefault("smoke", ctx.smoke)
        path = OUT_DIR / f"{bench.name}.json"
        path.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
        print()
        print(format_report(report))
        print(f"  (took {elapsed:.0f} s; figures written to {path})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
