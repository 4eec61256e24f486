"""Shared pieces of the benchmarks: sample statistics, the report a benchmark
returns (rows of "ours versus baseline" with a target ratio), and proof by PID
that every process a benchmark started has exited.

Kept free of ``hvd_notebook`` imports so that a benchmark module decides itself
what it imports and when (import time can be part of what it measures).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import psutil
except ImportError:  # a bare Python (the device check's summary) needs none of the process helpers
    psutil = None


@dataclass
class Samples:
    """Repeated timings of one thing, in seconds."""

    values: list[float] = field(default_factory=list)

    def add(self, seconds: float) -> None:
        self.values.append(seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else math.nan

    @property
    def p90(self) -> float:
        """90th percentile (inclusive method: stays within the observed range)."""
        if len(self.values) < 2:
            return self.median
        return statistics.quantiles(self.values, n=10, method="inclusive")[-1]

    def summary(self, scale: float = 1.0) -> dict[str, Any]:
        """Median, p90, min, max and every sample, multiplied by ``scale``."""
        vals = [v * scale for v in self.values]
        return {
            "n": len(vals),
            "median": self.median * scale,
            "p90": self.p90 * scale,
            "min": min(vals) if vals else math.nan,
            "max": max(vals) if vals else math.nan,
            "samples": [round(v, 6) for v in vals],
        }


@dataclass
class Row:
    """One line of a report: our figure against the baseline's.

    ``target`` is the largest acceptable ratio ours/baseline; None marks a row
    shown for information only (no PASS/FAIL). ``skipped`` says why a row could
    not be measured here (no GPU, a transport missing) instead of a figure.
    """

    measure: str
    unit: str
    ours: float
    baseline: float
    target: float | None = None
    skipped: str | None = None

    @property
    def ratio(self) -> float:
        return self.ours / self.baseline if self.baseline > 0 else math.inf

    @property
    def verdict(self) -> str:
        if self.skipped:
            return "skipped"
        if self.target is None:
            return "info"
        return "PASS" if self.ratio <= self.target else "FAIL"

    def as_dict(self) -> dict[str, Any]:
        return {
            "measure": self.measure,
            "unit": self.unit,
            "ours": self.ours,
            "baseline": self.baseline,
            "ratio": self.ratio,
            "target_max_ratio": self.target,
            "verdict": self.verdict,
            **({"skipped": self.skipped} if self.skipped else {}),
        }


@dataclass
class Report:
    """What a benchmark hands back to ``run.py``: rows for the table, notes to
    print under it, and everything else for the JSON file."""

    name: str
    title: str
    ours_label: str
    baseline_label: str
    rows: list[Row]
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "benchmark": self.name,
            "title": self.title,
            "ours": self.ours_label,
            "baseline": self.baseline_label,
            "rows": [r.as_dict() for r in self.rows],
            "notes": self.notes,
            **self.data,
        }


@dataclass
class Context:
    """Settings every benchmark gets from the command line."""

    quick: bool = False  # a short smoke run: fewer repetitions, figures are rough
    # the test suite's run (implies quick): the least that shows each benchmark's harness works and makes its rows;
    # its figures mean nothing (fewer rounds, no disk-cache warm-up, one cluster for progress and panel)
    smoke: bool = False


# ------------------------------------------------------------------ processes
def run_worker(worker: Path, ranks: int, ctx: Context, mpiexec: str, python: str = sys.executable,
               env: dict[str, str] | None = None) -> dict:
    """Run ``worker`` under ``mpiexec -n ranks``; it writes its figures as JSON to the
    path it is given, which this returns (an error with the worker's output if it fails)."""
    out = Path(tempfile.mkdtemp()) / f"{worker.stem}-{ranks}.json"
    cmd = [mpiexec, "-n", str(ranks), python, str(worker), str(out)] + (["--quick"] if ctx.quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"{worker.name} on {ranks} rank(s) failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def torch_collectives_during(fn: Any) -> int:
    """How many collectives ``fn()`` issues on any ``torch.distributed`` process group, from any thread
    (counted on the methods of ``ProcessGroup``, through which every collective call goes): tells
    whether the PyTorch binding's data really travels through ``torch.distributed``."""
    from torch._C._distributed_c10d import ProcessGroup

    collectives = ("broadcast", "allreduce", "allreduce_coalesced", "reduce", "allgather", "all_gather_single",
                   "_allgather_base", "allgather_coalesced", "all_gather_single_coalesced",
                   "allgather_into_tensor_coalesced", "gather", "scatter", "reduce_scatter", "reduce_scatter_single",
                   "_reduce_scatter_base", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
                   "all_to_all_single", "alltoall_base", "alltoall")
    names = [n for n in collectives if n in vars(ProcessGroup)]
    saved, count = {n: vars(ProcessGroup)[n] for n in names}, [0]  # the class's own entries, put back as they were

    def counted(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return method(*args, **kwargs)
        return call

    for n in names:
        setattr(ProcessGroup, n, counted(saved[n]))
    try:
        fn()
    finally:
        for n in names:
            setattr(ProcessGroup, n, saved[n])
    return count[0]


def descendants() -> dict[int, str]:
    """PID -> command line of every live process below this one."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out[p.pid] = " ".join(p.cmdline())[:120]
        except psutil.NoSuchProcess:
            pass
    return out


def still_running(pids: dict[int, str], timeout: float) -> dict[int, str]:
    """Wait up to ``timeout`` s for ``pids`` to exit; return those still alive
    (zombies count as gone). Does not reap: launchers own their children."""
    deadline = time.monotonic() + timeout
    while True:
        alive = {}
        for pid, cmd in pids.items():
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE and " ".join(p.cmdline())[:120] == cmd:
                    alive[pid] = cmd
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def kill(pids: dict[int, str]) -> None:
    """SIGKILL processes this benchmark started and that outlived their stop."""
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


def foreign_cluster_processes() -> dict[int, str]:
    """ipyparallel/MPI processes on this machine that this run did not start:
    they compete for the CPUs and skew the figures."""
    mine = set(descendants())
    out = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["pid"] not in mine and p.info["pid"] != psutil.Process().pid and (
            "ipyparallel" in cmd or "mpiexec" in cmd or "hydra_pmi_proxy" in cmd
        ):
            out[p.info["pid"]] = cmd[:120]
    return out


def ipython_shell() -> Any:
    """The real IPython shell IPython's own tests use, with ``%load_ext hvd_notebook``
    (one per process: the benchmarks that drive magics share it)."""
    from IPython.testing import globalipapp

    shell = globalipapp.start_ipython() or globalipapp.get_ipython()
    if "hvd_notebook" not in shell.extension_manager.loaded:
        shell.run_line_magic("load_ext", "hvd_notebook")
    return shell
