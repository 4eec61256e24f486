"""On one GPU, with PyTorch and cupy (the lent GPU machine's stack): hvd.allreduce of a CUDA tensor through
the runtime's NCCL core against a raw NCCL allreduce (cupy) on the same memory, 1 MiB .. 256 MiB
(target, issue 18: within 5 %); and a step's gradients, ResNet-50's 161 tensors, reduced in one grouped
call and one call each, against one raw NCCL call on all their bytes (a report).

Not part of `make bench` (it needs an NVIDIA GPU, PyTorch's CUDA build and cupy):
`benchmarks/run.py gpu`, which `benchmarks/gpu_check.sh` runs after the `gpu` tests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from common import Context, Report, Row, run_worker

HERE = Path(__file__).resolve().parent
TARGET = 1.05


def run(ctx: Context) -> Report:
    sys.path.insert(0, str(HERE.parent))
    from hvd_notebook.cluster.launching.placements import find_mpiexec

    res = run_worker(HERE / "mpi_gpu_worker.py", 1, ctx, mpiexec=find_mpiexec(None),
                     env={"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES") or "0"})
    rows = [Row(f"allreduce {int(nbytes) >> 20} MiB: hvd (torch CUDA tensor) vs raw NCCL (cupy)", "ms",
                r["hvd_s"] * 1e3, r["raw_nccl_s"] * 1e3, TARGET) for nbytes, r in res["sizes"].items()]
    grads = res.get("gradients")
    if grads:
        what = f"{grads['tensors']} gradients of ResNet-50 ({grads['nbytes'] >> 20} MiB)"
        rows += [Row(f"{what}: one grouped_allreduce vs one raw NCCL allreduce of their bytes", "ms",
                     grads["grouped_s"] * 1e3, grads["raw_nccl_s"] * 1e3),
                 Row(f"{what}: an allreduce_async each, then synchronize vs the same raw call", "ms",
                     grads["per_tensor_s"] * 1e3, grads["raw_nccl_s"] * 1e3)]
    notes = [f"{res['gpu']}, torch {res['torch']}, cupy {res['cupy']}, NCCL {res['nccl']}; one rank (NCCL refuses "
             "two ranks on one GPU), so NCCL's allreduce is a device copy and the runtime's own cost shows whole",
             "medians; ours and raw interleaved, each timed between two device syncs"]
    if ctx.quick:
        notes.append("--quick: few samples, figures are rough")
    return Report(name="gpu", title="one GPU: the NCCL core from PyTorch vs raw NCCL", ours_label="hvd",
                  baseline_label="raw NCCL", rows=rows, notes=notes, data=res)
