"""`make bench` keeps working: a smoke run of every benchmark (`--smoke`: `--quick` with fewer rounds, one
cluster for the progress and panel benchmarks, no interrupt in the soak) completes and writes each one's rows
(the figures themselves are a report, not a test), the PyTorch rows over torch.distributed's transport among
them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)  # (every benchmark once: ~3-4 min on a slow 2-core VM)
def test_smoke_benchmark_run_writes_figures():
    proc = subprocess.run([sys.executable, "benchmarks/run.py", "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "start -n 2 to ready" in proc.stdout and "empty cell %%hvd vs %%px" in proc.stdout
    figures = json.loads((ROOT / "build" / "bench" / "cluster.json").read_text())
    assert figures["quick"] is True and figures["smoke"] is True
    rows = {r["measure"]: r for r in figures["rows"]}
    start = rows["start -n 2 to ready, median"]
    assert start["ours"] > 0 and start["baseline"] > 0
    # the PyTorch rows over each transport, the dist ones measured where hvd's data really took torch.distributed
    over = [r for r in json.loads((ROOT / "build" / "bench" / "torch.json").read_text())["rows"]
            if "over transport" in r["measure"]]
    assert len(over) == 6 and not any(r.get("skipped") for r in over), over
    for name in ("allreduce", "keras", "noise_scale", "progress", "panel", "elastic", "soak"):
        figures = json.loads((ROOT / "build" / "bench" / f"{name}.json").read_text())
        assert figures["quick"] is True and figures["rows"]
        assert all(r["ours"] > 0 and r["baseline"] > 0 for r in figures["rows"]), figures["rows"]
