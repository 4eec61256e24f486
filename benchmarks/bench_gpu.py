"""One GPU, one rank, the reduction forced (HVD_NOTEBOOK_REDUCE_ALONE=1): the rows of mpi_gpu_worker.py as a
report, with issue 51's targets: `hvd.allreduce` of 1 MiB within 1.5x of raw `dist.all_reduce` (and against
raw cupy NCCL, a report); ResNet-50's 161 gradients in one `grouped_allreduce` within 3x of one raw call on
their bytes; a ResNet-50 step under `hvd.DistributedOptimizer` within 1.05x of DDP's; the host back from
backward and `step()` at most half way through a step behind a queued 0.2 s GPU sleep.

Not part of `make bench` (it needs an NVIDIA GPU): `benchmarks/run.py gpu`; the device check
(`gpu_check.sh`) runs the worker itself and turns its JSON into these rows with `summarize`:

    python benchmarks/bench_gpu.py summarize OUTDIR   # OUTDIR/gpu-check.json from the steps' files
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from common import Context, Report, Row, run_worker

HERE = Path(__file__).resolve().parent
ALLREDUCE_TARGET, GROUPED_TARGET, STEP_TARGET, HOST_TARGET = 1.5, 3.0, 1.05, 0.5


def backend_row(what: str, r: dict[str, Any], unit: str, scale: float) -> Row:
    """hvd's NCCL backend on cupy arrays (TensorFlow's GPU path, timed without TensorFlow) against raw cupy
    NCCL: a report."""
    if "hvd_cupy_s" in r and "raw_cupy_s" in r:
        return Row(what, unit, r["hvd_cupy_s"] * scale, r["raw_cupy_s"] * scale)
    why = r.get("hvd_cupy_skipped") or r.get("raw_cupy_skipped") or "not measured"
    return Row(what, unit, float("nan"), float("nan"), skipped=why)


def allreduce_rows(rows: dict[str, Any]) -> list[Row]:
    r = rows.get("allreduce_1mib")
    if r is None:
        return []
    out = [Row("allreduce 1 MiB: hvd vs raw dist.all_reduce", "us", r["hvd_s"] * 1e6, r["raw_dist_s"] * 1e6,
               ALLREDUCE_TARGET)]
    out.append(backend_row("allreduce 1 MiB: hvd's NCCL backend on a cupy array vs raw NCCL (cupy)", r, "us", 1e6))
    cupy = "allreduce 1 MiB: hvd vs raw NCCL (cupy)"
    if "raw_cupy_s" in r:
        return out + [Row(cupy, "us", r["hvd_s"] * 1e6, r["raw_cupy_s"] * 1e6)]
    return out + [Row(cupy, "us", r["hvd_s"] * 1e6, float("nan"), skipped=r["raw_cupy_skipped"])]


def gradient_rows(rows: dict[str, Any]) -> list[Row]:
    g = rows.get("gradients")
    if g is None:
        return []
    what = f"{g['tensors']} gradients of ResNet-50 ({g['nbytes'] >> 20} MiB): one grouped_allreduce vs one raw"
    out = [Row(f"{what} dist.all_reduce of their bytes", "ms", g["grouped_s"] * 1e3, g["raw_dist_s"] * 1e3,
               GROUPED_TARGET),
           backend_row(f"{g['tensors']} cupy arrays of ResNet-50's shapes: one call of hvd's NCCL backend vs one raw "
                       "NCCL call (cupy) of their bytes", g, "ms", 1e3)]
    if "raw_cupy_s" in g:
        return out + [Row(f"{what} NCCL call (cupy)", "ms", g["grouped_s"] * 1e3, g["raw_cupy_s"] * 1e3)]
    return out + [Row(f"{what} NCCL call (cupy)", "ms", g["grouped_s"] * 1e3, float("nan"),
                      skipped=g["raw_cupy_skipped"])]


def step_rows(rows: dict[str, Any]) -> list[Row]:
    s = rows.get("step")
    if s is None:
        return []
    what = f"{s['model']} step, batch {s['batch']}"
    return [Row(f"{what}: DistributedOptimizer vs DDP", "ms", s["hvd_step_s"] * 1e3, s["ddp_step_s"] * 1e3,
                STEP_TARGET),
            Row(f"{what}: what each adds to the compute alone, DistributedOptimizer vs DDP", "ms",
                (s["hvd_step_s"] - s["compute_s"]) * 1e3, (s["ddp_step_s"] - s["compute_s"]) * 1e3)]


def host_rows(rows: dict[str, Any]) -> list[Row]:
    h = rows.get("host_overhead")
    if h is None:
        return []
    what = "host back from backward + step() vs the GPU's end, behind a queued 0.2 s sleep"
    if h.get("host_ahead_skipped"):
        return [Row(what, "ms", h["host_back_s"] * 1e3, h["gpu_end_s"] * 1e3, skipped=h["host_ahead_skipped"])]
    return [Row(what, "ms", h["host_back_s"] * 1e3, h["gpu_end_s"] * 1e3, HOST_TARGET)]


def rows_of(result: dict[str, Any]) -> list[Row]:
    """The report's rows from the worker's JSON (rows it did not reach are left out; `checks` says so)."""
    rows = result.get("rows", {})
    return allreduce_rows(rows) + gradient_rows(rows) + step_rows(rows) + host_rows(rows)


def checks_of(result: dict[str, Any]) -> dict[str, Any]:
    """What must hold whatever the timings: hvd's data through torch.distributed, each row ran, the values after
    a step, no host sync in a step."""
    rows, errors = result.get("rows", {}), result.get("errors", {})
    host, debug = rows.get("host_overhead", {}), rows.get("sync_debug", {})
    return {"through_torch_distributed": (result.get("environment") or {}).get("hvd_through_torch_distributed"),
            "rows_missing": [n for n in ("allreduce_1mib", "gradients", "host_overhead", "sync_debug", "step")
                             if n not in rows and n not in errors],
            "row_errors": errors,
            "values_right_after_step": host.get("values", {}).get("right"),
            "host_ahead_of_gpu": host.get("host_ahead_skipped") or host.get("host_ahead"),
            "step_under_sync_debug_error": debug.get("skipped") or debug.get("passed"),
            "sync_debug": {k: v for k, v in debug.items() if k in ("plain", "hvd")}}


def run(ctx: Context) -> Report:
    sys.path.insert(0, str(HERE.parent))
    from hvd_notebook.cluster.launching.placements import find_mpiexec

    res = run_worker(HERE / "mpi_gpu_worker.py", 1, ctx, mpiexec=find_mpiexec(None),
                     env={"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES") or "0",
                          "HVD_NOTEBOOK_REDUCE_ALONE": "1"})
    notes = [f"{json.dumps(res.get('environment'))}; one rank (NCCL refuses two on one GPU), the reduction forced",
             f"checks: {json.dumps(checks_of(res))}"]
    if ctx.quick:
        notes.append("--quick: few samples, figures are rough")
    return Report(name="gpu", title="one GPU: the PyTorch binding vs raw torch.distributed, cupy NCCL and DDP",
                  ours_label="hvd", baseline_label="baseline", rows=rows_of(res), notes=notes, data=res)


# ------------------------------------------------------------------------------- the device check's summary
def load(folder: Path, name: str) -> Any:
    path = folder / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def steps_of(folder: Path) -> list[dict[str, Any]]:
    path = folder / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def tests_of(folder: Path) -> dict[str, int] | None:
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(folder / "gpu-tests.xml").getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def passed(report: dict[str, Any]) -> bool:
    """Every step ended 0 and every check held (a skipped check, with its reason, holds; timings are a report)."""
    checks = report["checks"]
    held = [checks["through_torch_distributed"], checks["values_right_after_step"], checks["host_ahead_of_gpu"],
            checks["step_under_sync_debug_error"]]
    return (all(s["rc"] == 0 for s in report["steps"]) and not checks["rows_missing"] and not checks["row_errors"]
            and all(held))


def summarize(folder: Path) -> dict[str, Any]:
    """gpu-check.json from what the steps have written so far: run after each step, so that a step killed at
    its time limit (or the whole command killed) still leaves the summary of everything before it."""
    worker = load(folder, "rows.json") or {}
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "rehearsal": os.environ.get("GPU_CHECK_REHEARSE")
                              == "1", "environment": worker.get("environment"), "steps": steps_of(folder),
                              "rows": [r.as_dict() for r in rows_of(worker)], "checks": checks_of(worker),
                              "worker": worker, "tests": tests_of(folder), "cell": load(folder, "cell.json"),
                              "panel": load(folder, "panel.json")}
    report["passed"] = passed(report)
    (folder / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def print_summary(report: dict[str, Any]) -> None:
    for s in report["steps"]:
        print(f"step {s['step']}: rc {s['rc']} in {s['seconds']} s" + (" (TIMED OUT)" if s["timed_out"] else ""))
    for r in report["rows"]:
        target = f"<= {r['target_max_ratio']}x" if r["target_max_ratio"] else "a report"
        print(f"{r['measure']}: " + (f"skipped: {r['skipped']}" if r.get("skipped") else
              f"{r['ours']:.4g} vs {r['baseline']:.4g} {r['unit']} = {r['ratio']:.2f}x ({target}): {r['verdict']}"))
    print(f"checks: {json.dumps(report['checks'])}")
    if report["tests"]:
        print(f"gpu tests: {json.dumps(report['tests'])}")
    print(f"== gpu_check: {'PASSED' if report['passed'] else 'FAILED'}")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "summarize":
        sys.exit("usage: python benchmarks/bench_gpu.py summarize OUTDIR")
    summary = summarize(Path(sys.argv[2]))
    if "--print" in sys.argv:
        print_summary(summary)
