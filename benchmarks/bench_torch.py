"""The PyTorch binding (hvd_notebook.runtime.torch), 2 CPU ranks, side by side in one run:

- hvd.allreduce of a float32 torch tensor vs mpi4py's Allreduce on numpy buffers of the same size
  (4 KiB, 1 MiB, 16 MiB): targets as for TensorFlow tensors (within 2x at 4 KiB, 1.1x from 1 MiB);
- a training step with hvd.DistributedOptimizer vs the same step under DistributedDataParallel
  (gloo) on the same MLP (1.6 M parameters): target within 1.1x; and on a model with ResNet-18's shape of
  gradients (62 tensors, 11 M parameters, half of them tiny): target within 1.05x;
- over each transport of the binding's CPU tensors (the default, MPI; then torch.distributed's gloo, with
  HVD_NOTEBOOK_TORCH_TRANSPORT=dist set on every rank later in the same run): hvd.allreduce of 4 KiB and
  1 MiB against a raw `dist.all_reduce` (a report), and the step on ResNet-18's shape of gradients against
  DDP (target within 1.05x, issue 51); where the dist transport is missing its rows say so, not a figure;
- overlap: a backward pass with a 15 ms delay per layer (compute that leaves the CPU free, as a GPU's
  does) and 8 MiB of gradient per layer: backward under DistributedOptimizer until every gradient is
  reduced, against backward alone, the reduction alone and their sum. Target: closer to
  max(compute, communication) than to their sum (at most their midpoint).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from common import Context, Report, Row, run_worker

HERE = Path(__file__).resolve().parent
LARGE_TARGET, SMALL_TARGET, DDP_TARGET, MANY_SMALL_TARGET = 1.1, 2.0, 1.1, 1.05  # (the last: issue 42)


def transport_rows(res: dict, transport: str) -> list[Row]:
    """hvd.allreduce against raw dist.all_reduce, and the 62-tensor step against DDP, over one transport."""
    what = f"over transport {transport}"
    measures = [(f"allreduce {label}, {what}: hvd vs raw dist.all_reduce (gloo)", "us", key, None)
                for label, key in (("4 KiB", str(4 << 10)), ("1 MiB", str(1 << 20)))]
    step = f"training step, 62 tensors (ResNet-18's shape), {what}: DistributedOptimizer vs DDP (gloo)"
    if "unavailable" in res:
        why = f"transport {transport} not available: {res['unavailable']}"
        return [Row(m, unit, math.nan, math.nan, target, skipped=why)
                for m, unit, _, target in measures + [(step, "ms", "", MANY_SMALL_TARGET)]]
    rows = [Row(m, unit, res["raw_dist"][key]["hvd_s"] * 1e6, res["raw_dist"][key]["raw_dist_s"] * 1e6, target)
            for m, unit, key, target in measures]
    d = res["ddp_many_small"]
    return rows + [Row(step, "ms", d["hvd_step_s"] * 1e3, d["ddp_step_s"] * 1e3, MANY_SMALL_TARGET)]


def run(ctx: Context) -> Report:
    sys.path.insert(0, str(HERE.parent))
    from hvd_notebook.cluster.launching.launch import rank_environment
    from hvd_notebook.cluster.launching.placements import find_mpiexec

    res = run_worker(HERE / "mpi_torch_worker.py", 2, ctx, mpiexec=find_mpiexec(None), env=rank_environment())
    dist = res["over_dist"]
    if dist["transport"] != "dist":
        dist["unavailable"] = dist.get("error") or "hvd.allreduce issued no torch.distributed collective"
    us = 1e6
    rows = []
    for nbytes, r in res["sizes"].items():
        nbytes = int(nbytes)
        label = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
        rows.append(Row(f"allreduce {label}: hvd (torch tensor) vs mpi4py Allreduce", "us", r["hvd_s"] * us,
                        r["raw_mpi_s"] * us, LARGE_TARGET if nbytes >= 1 << 20 else SMALL_TARGET))
    d = res["ddp"]
    rows.append(Row(f"training step, MLP of {d['parameters'] / 1e6:.1f} M parameters: DistributedOptimizer vs "
                    "DistributedDataParallel (gloo)", "ms", d["hvd_step_s"] * 1e3, d["ddp_step_s"] * 1e3, DDP_TARGET))
    rows += transport_rows(res, "mpi") + transport_rows(res["over_dist"], "dist")
    o = res["overlap"]
    longer, total = max(o["compute_s"], o["communication_s"]), o["compute_s"] + o["communication_s"]
    rows.append(Row("overlap: backward + reduction under DistributedOptimizer vs the midpoint of max and sum", "ms",
                    o["step_s"] * 1e3, (longer + total) / 2 * 1e3, 1.0))
    rows.append(Row("overlap: backward + reduction under DistributedOptimizer vs the two one after the other", "ms",
                    o["step_s"] * 1e3, total * 1e3))
    hidden = (total - o["step_s"]) / min(o["compute_s"], o["communication_s"])
    notes = [
        f"overlap: compute alone {o['compute_s'] * 1e3:.0f} ms, communication alone "
        f"{o['communication_s'] * 1e3:.0f} ms ({o['gradient_mib']:.0f} MiB of gradients), both under "
        f"DistributedOptimizer "
        f"{o['step_s'] * 1e3:.0f} ms: {hidden:.0%} of the shorter one hidden behind the longer",
        f"torch {res['torch']}; medians, ours and the baseline interleaved, each after a barrier; the transport "
        f"rows of dist later in the same run, with HVD_NOTEBOOK_TORCH_TRANSPORT=dist set on both ranks",
    ]
    if ctx.quick:
        notes.append("--quick: few samples, figures are rough")
    return Report(name="torch", title="the PyTorch binding, 2 CPU ranks", ours_label="hvd", baseline_label="baseline",
                  rows=rows, notes=notes, data=res)
