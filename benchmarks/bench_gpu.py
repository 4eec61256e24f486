"""On one GPU: hvd.allreduce of a TensorFlow GPU tensor against a raw NCCL allreduce (cupy) of the same
bytes, 1 MiB .. 1 GiB, and a small CNN's training rate with DistributedOptimizer against the plain
optimizer. A report, with no targets yet: these figures have not been measured on a GPU before.

Not part of `make bench` (it needs an NVIDIA GPU, TensorFlow's CUDA build and cupy):
`benchmarks/run.py gpu`, which `benchmarks/gpu_check.sh` runs after the `gpu` tests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from common import Context, Report, Row, run_worker

HERE = Path(__file__).resolve().parent


def run(ctx: Context) -> Report:
    sys.path.insert(0, str(HERE.parent))
    from hvd_notebook.cluster import find_mpiexec

    res = run_worker(HERE / "mpi_gpu_worker.py", 1, ctx, mpiexec=find_mpiexec(None),
                     env={"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES") or "0"})

    rows = []
    for nbytes, r in res["bandwidth"]["sizes"].items():
        nbytes = int(nbytes)
        rows.append(Row(f"allreduce {nbytes >> 20} MiB: hvd (TF GPU tensor) vs raw NCCL (cupy)", "ms",
                        r["hvd_s"] * 1e3, r["raw_nccl_s"] * 1e3))
    t = res["training"]
    rows.append(Row("1 rank: time per sample, DistributedOptimizer vs plain", "us/sample",
                    1e6 / t["distributed_samples_per_s"], 1e6 / t["plain_samples_per_s"]))
    notes = [f"{res['gpu']}, TensorFlow {res['tensorflow']}, cupy {res['cupy']}, NCCL {res['nccl']}",
             f"each time includes one device sync ({res['bandwidth']['sync_s'] * 1e6:.0f} us)",
             f"training: small CNN, 28x28 synthetic images, batch {t['batch']}, {t['samples']} samples"]
    if res["bandwidth"].get("skipped"):
        notes.append(f"sizes skipped for want of GPU memory: {res['bandwidth']['skipped']}")
    if ctx.quick:
        notes.append("--quick: few sizes and samples, figures are rough")
    return Report(name="gpu", title="NCCL collectives and training on one GPU", ours_label="hvd",
                  baseline_label="reference", rows=rows, notes=notes, data=res)
