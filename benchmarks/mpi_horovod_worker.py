"""Runs inside `mpiexec -n 2` in the horovod environment (make test-horovod builds it):
times a real Horovod's allreduce like mpi_allreduce_worker.py times hvd_notebook's.

    mpiexec -n 2 HOROVOD_ENV/bin/python benchmarks/mpi_horovod_worker.py OUT.json [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402


def median_time(fn, reps: int, comm) -> float:
    for _ in range(max(2, reps // 10)):
        fn()
    samples = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    out_path, quick = sys.argv[1], "--quick" in sys.argv
    hvd.init()
    comm = MPI.COMM_WORLD.Dup()
    small = tf.random.uniform([1024])
    tensors = [tf.random.uniform([4096]) for _ in range(200)]
    results = {
        "version": horovod.__version__,
        "tensorflow": tf.__version__,
        "allreduce_4kib_s": median_time(lambda: hvd.allreduce(small, op=hvd.Sum), 50 if quick else 500, comm),
        "grouped_s": median_time(lambda: hvd.grouped_allreduce(tensors, op=hvd.Sum), 3 if quick else 10, comm),
        "singles_s": median_time(lambda: [hvd.allreduce(t, op=hvd.Sum) for t in tensors], 3 if quick else 10, comm),
    }
    if hvd.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
