"""``hvd-notebook scaling``: how training scales on this node, measured as Horovod's slides measured it, and
projected to more GPUs by a stated model.

Measured: for each number of ranks (1 .. N, one per GPU where there are GPUs), a PyTorch model on synthetic
data (``engine/scaling_worker.py``, started by ``hvd-notebook run``), its step under
``hvd.DistributedOptimizer`` and under DDP; images per second over all ranks, and the efficiency against N
times one rank's compute alone.

Projected (a model, not a measurement): the same step on 8, 64 and 256 GPUs, from the one-rank compute
(forward, and backward with the update), the gradients' buckets in backward's order, and a ring allreduce's
cost per bucket, ``2 (n-1)/n * bytes / bandwidth + 2 (n-1) * latency``, over the links of ``Links`` (NVLink
within a node, InfiniBand across nodes, each figure overridable). Communication overlaps backward: what a
step waits for is the last bucket's reduction, or all of them less the backward pass where that is longer.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import private
from .cluster.errors import ClusterError
from .cluster.launching.run import Job, run_job
from .config import ClusterOptions
from .dashboard.formatting import text_table

WORKER = "hvd_notebook.engine.scaling_worker"
PROJECTED_GPUS = (8, 64, 256)


@dataclass(frozen=True)
class Links:
    """The links a projection assumes: within a node of ``gpus_per_node`` GPUs, NCCL's bus bandwidth over
    NVLink (GB/s); across nodes, each GPU's share of InfiniBand (NDR, 400 Gb/s per GPU: 50 GB/s); and the
    latency of one step of the ring on each (microseconds). Each field is an option of the command."""

    gpus_per_node: int = field(default=8, metadata={"help": "GPUs per node"})
    intra_gbps: float = field(default=300.0, metadata={"help": "GB/s within a node (NVLink)"})
    inter_gbps: float = field(default=50.0, metadata={"help": "GB/s per GPU across nodes (InfiniBand)"})
    intra_latency_us: float = field(default=2.0, metadata={"help": "microseconds per ring step within a node"})
    inter_latency_us: float = field(default=5.0, metadata={"help": "microseconds per ring step across nodes"})

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, not {value:g}")

    def describe(self) -> str:
        return (f"{self.gpus_per_node} GPUs per node; within a node {self.intra_gbps:g} GB/s, "
                f"{self.intra_latency_us:g} us per ring step (NVLink); across nodes {self.inter_gbps:g} GB/s per "
                f"GPU, {self.inter_latency_us:g} us per ring step (InfiniBand)")


def ring_allreduce_s(nbytes: float, ranks: int, links: Links) -> float:
    """Seconds a ring allreduce of ``nbytes`` takes on ``ranks`` GPUs: each sends and receives ``2 (n-1)/n`` of
    the bytes over the slowest link on the ring, in ``2 (n-1)`` steps."""
    if ranks <= 1:
        return 0.0
    across = ranks > links.gpus_per_node
    bandwidth = (links.inter_gbps if across else links.intra_gbps) * 1e9
    latency = (links.inter_latency_us if across else links.intra_latency_us) * 1e-6
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * latency


@dataclass(frozen=True)
class Projection:
    ranks: int
    communication_s: float  # every bucket's allreduce, one after the other
    waited_s: float  # what the step waits for after its compute
    step_s: float
    efficiency: float  # against the same number of GPUs each training alone
    images_per_s: float


def project(point: dict[str, Any], ranks: int, links: Links) -> Projection:
    """The step of ``point`` (a one-rank measurement) on ``ranks`` GPUs, by the model above."""
    buckets = point["bucket_bytes"] or [point["gradient_bytes"]]
    communication = sum(ring_allreduce_s(b, ranks, links) for b in buckets)
    backward = max(0.0, point["compute_s"] - point["forward_s"])
    waited = max(ring_allreduce_s(buckets[-1], ranks, links), communication - backward) if ranks > 1 else 0.0
    step = point["compute_s"] + waited
    return Projection(ranks, communication, waited, step, point["compute_s"] / step, ranks * point["batch"] / step)


def efficiency(point: dict[str, Any], one: dict[str, Any], key: str) -> float:
    """Images per second of ``point``'s step ``key`` on all its ranks, against its ranks times one rank's
    compute alone (``one``: the one-rank point)."""
    return one["compute_s"] / point[key]


def measure(ranks: int, model: str, batch: int, steps: int, rounds: int, threads: int,
            options: ClusterOptions) -> dict[str, Any]:
    """One point: the worker on ``ranks`` ranks through ``hvd-notebook run`` (``threads`` each on CPUs); its
    figures."""
    with tempfile.TemporaryDirectory(prefix="scaling-", dir=private.base_dir()) as folder:
        out = Path(folder) / "point.json"
        command = (sys.executable, "-m", WORKER, str(out), model, str(batch), str(steps), str(rounds), str(threads))
        code = run_job(Job(command, replace(options, n=ranks)))
        if code or not out.exists():
            raise ClusterError(f"the run on {ranks} rank(s) failed (exit code {code}); its output is above.")
        return json.loads(out.read_text())


def report(points: list[dict[str, Any]], links: Links) -> str:
    """The measured table, then the projection from the one-rank point."""
    one = points[0]
    rows = []
    for p in points:
        rows.append([str(p["ranks"]), *(f for key in ("hvd_step_s", "ddp_step_s") for f in (
            f"{p[key] * 1e3:.1f}", f"{p['ranks'] * p['batch'] / p[key]:.1f}", f"{efficiency(p, one, key):.0%}"))])
    lines = [f"{one['model']} on {one['device']}, batch {one['batch']} per rank, {one['parameters'] / 1e6:.1f} M "
             f"parameters ({one['gradient_bytes'] / 2**20:.0f} MiB of gradients in {len(one['bucket_bytes'])} "
             f"buckets); one rank's compute alone {one['compute_s'] * 1e3:.1f} ms a step "
             f"(forward {one['forward_s'] * 1e3:.1f} ms)", "",
             "measured (medians; efficiency: images/s against the ranks times one rank's compute alone)",
             text_table([["ranks", "hvd step ms", "hvd img/s", "hvd eff.", "DDP step ms", "DDP img/s", "DDP eff."],
                         *rows]), "",
             f"projected: a model, not a measurement ({links.describe()}; ring allreduce per bucket, overlapping "
             "backward)"]
    rows = []
    for n in PROJECTED_GPUS:
        proj = project(one, n, links)
        rows.append([str(n), f"{proj.communication_s * 1e3:.1f}", f"{proj.waited_s * 1e3:.1f}",
                     f"{proj.step_s * 1e3:.1f}", f"{proj.images_per_s:.0f}", f"{proj.efficiency:.0%}"])
    lines.append(text_table([["GPUs", "allreduce ms", "waited ms", "step ms", "img/s", "efficiency"], *rows]))
    return "\n".join(lines)


def ranks_list(text: str) -> list[int]:
    """``1,2,4`` or ``4`` (1 .. 4) as a sorted list that starts at 1; a ValueError for anything else."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"-n takes positive numbers of ranks, e.g. 4 or 1,2,4, not {text!r}")
    if len(values) == 1:
        values = [1 << i for i in range(values[0].bit_length()) if 1 << i < values[0]] + [values[0]]
    return sorted({1, *values})


def run(ranks: list[int], model: str, batch: int, steps: int, rounds: int, links: Links, options: ClusterOptions,
        out: Path | None = None) -> int:
    """``hvd-notebook scaling``: measure each point, print the report, write the figures to ``out``."""
    if model != "mlp" and importlib.util.find_spec("torchvision") is None:
        raise ValueError(f"--model {model} needs torchvision (pip install torchvision), or take --model mlp")
    points = []
    threads = max(1, (os.cpu_count() or 1) // max(ranks))  # (CPU ranks: the same share of cores at every point)
    for n in ranks:
        print(f"hvd-notebook scaling: {n} rank(s) ...", file=sys.stderr, flush=True)
        points.append(measure(n, model, batch, steps, rounds, threads, options))
    print(report(points, links))
    if out is not None:
        projections = [vars(project(points[0], n, links)) for n in PROJECTED_GPUS]
        out.write_text(json.dumps({"points": points, "links": vars(links), "projected": projections}, indent=1))
    return 0
