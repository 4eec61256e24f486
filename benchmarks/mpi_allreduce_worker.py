"""Runs inside `mpiexec -n 2` for bench_allreduce.py: times hvd collectives
against raw mpi4py on the same buffers, interleaved, and rank 0 writes JSON.

    mpiexec -n 2 python benchmarks/mpi_allreduce_worker.py OUT.json [--quick]

With HVD_BENCH_SMOKE=1 (run.py --smoke, the test suite's run), the fewest calls that still give every figure.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402
from mpi_timing import best_back_to_back, median_blocks, median_pair, timed  # noqa: E402

import hvd_notebook.runtime as hvd  # noqa: E402
from hvd_notebook.runtime.core import negotiation, world  # noqa: E402
from hvd_notebook.runtime.core.signatures import allreduce_signature  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)


def _nothing() -> None:
    pass


def main() -> None:
    out_path, quick = sys.argv[1], "--quick" in sys.argv
    smoke = os.environ.get("HVD_BENCH_SMOKE") == "1"
    hvd.init()
    comm = MPI.COMM_WORLD.Dup()
    results: dict = {"sizes": {}}

    reps_for = {4 << 10: 2000, 1 << 20: 300, 16 << 20: 60, 64 << 20: 12}
    for nbytes, reps in reps_for.items():
        reps = 3 if smoke else max(3, reps // 10) if quick else reps
        n = nbytes // 4
        tensor = tf.random.uniform([n])
        send = np.random.rand(n).astype(np.float32)
        recv = np.empty_like(send)
        ours, raw = median_pair(lambda tensor=tensor: hvd.allreduce(tensor, op=hvd.Sum),
                                lambda send=send, recv=recv: comm.Allreduce(send, recv, op=MPI.SUM), reps, comm)
        results["sizes"][str(nbytes)] = {"hvd_s": ours, "raw_mpi_s": raw, "reps": reps}
        if nbytes == 1 << 20:
            ours, raw = median_blocks(lambda tensor=tensor: hvd.allreduce(tensor, op=hvd.Sum),
                                      lambda send=send, recv=recv: comm.Allreduce(send, recv, op=MPI.SUM),
                                      2 if smoke else 3 if quick else 10, 3 if smoke else 10 if quick else 30, comm)
            results["blocks_1mib"] = {"hvd_s": ours, "raw_mpi_s": raw}

    # 4 KiB calls back to back, no barrier before each (a training loop's small calls): best of 3 trials
    tensor, send = tf.random.uniform([1024]), np.random.rand(1024).astype(np.float32)
    recv = np.empty_like(send)
    ours, raw = [], []
    for _ in range(1 if smoke else 3):  # (the two sides alternate, so that drift hits both alike)
        ours.append(best_back_to_back(lambda: hvd.allreduce(tensor, op=hvd.Sum), 200, 1, comm))
        raw.append(best_back_to_back(lambda: comm.Allreduce(send, recv, op=MPI.SUM), 200, 1, comm))
    results["back_to_back_4kib"] = {"hvd_s": min(ours), "raw_mpi_s": min(raw), "calls": 200}

    # what counting the seconds in collectives costs (runtime/core/collective_time, for the dashboard's step
    # times): the same calls with the clock and with its enter/leave swapped for no-ops, rounds alternating
    counted = (negotiation._enter_collective, negotiation._leave_collective)
    timings: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 if smoke else 6 if quick else 30):
        for clock in ((True, False) if i % 2 == 0 else (False, True)):
            negotiation._enter_collective, negotiation._leave_collective = counted if clock else (_nothing, _nothing)
            timings[clock].append(best_back_to_back(lambda: hvd.allreduce(tensor, op=hvd.Sum), 200, 1, comm))
    negotiation._enter_collective, negotiation._leave_collective = counted
    results["collective_clock"] = {"with_s": min(timings[True]), "without_s": min(timings[False])}

    # 200 tensors of 16 KiB: one grouped call against 200 single calls
    tensors = [tf.random.uniform([4096]) for _ in range(200)]
    reps = 1 if smoke else 3 if quick else 10
    grouped, singles = median_pair(lambda: hvd.grouped_allreduce(tensors, op=hvd.Sum),
                                   lambda: [hvd.allreduce(t, op=hvd.Sum) for t in tensors], reps, comm)
    # the same inside tf.function, as in a compiled training step
    graph_grouped = tf.function(lambda: hvd.grouped_allreduce(tensors, op=hvd.Sum))
    graph_singles = tf.function(lambda: [hvd.allreduce(t, op=hvd.Sum) for t in tensors])
    g_grouped, g_singles = median_pair(graph_grouped, graph_singles, reps, comm)
    # the floor for any fused call: one raw MPI Allreduce of all 200 tensors' bytes
    send = np.random.rand(200 * 4096).astype(np.float32)
    grouped_again, raw_fused = median_pair(lambda: hvd.grouped_allreduce(tensors, op=hvd.Sum),
                                           lambda: comm.Allreduce(MPI.IN_PLACE, send, op=MPI.SUM), reps * 3, comm)
    graph_grouped_again, _ = median_pair(graph_grouped, lambda: comm.Allreduce(MPI.IN_PLACE, send, op=MPI.SUM),
                                         reps * 3, comm)
    # the same job by hand in mpi4py, as any fusion must do it: the inputs kept, 200 results of their own
    arrays = [np.random.rand(4096).astype(np.float32) for _ in range(200)]

    def by_hand() -> list[np.ndarray]:
        fused = np.concatenate(arrays)
        comm.Allreduce(MPI.IN_PLACE, fused, op=MPI.SUM)
        return np.split(fused, 200)

    grouped_third, hand_fused = median_pair(lambda: hvd.grouped_allreduce(tensors, op=hvd.Sum), by_hand, reps * 3,
                                            comm)
    results["grouped"] = {"grouped_s": grouped, "singles_s": singles, "graph_grouped_s": g_grouped,
                          "graph_singles_s": g_singles, "grouped_vs_raw_s": grouped_again,
                          "graph_grouped_vs_raw_s": graph_grouped_again, "raw_fused_s": raw_fused,
                          "grouped_vs_hand_s": grouped_third, "hand_fused_s": hand_fused, "tensors": 200,
                          "bytes_each": 16384}

    # the agreement check alone, repeated with the same signature, and the timeline's cost
    negotiator = world.current().negotiator
    sig = allreduce_signature(hvd.Sum, "float32", ((262144,),), 1.0, 1.0, "bench")
    reps = 200 if quick else 2000
    for _ in range(50):
        negotiator.check(sig)
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        negotiator.check(sig)
    check_s = (time.perf_counter() - t0) / reps
    mib = tf.random.uniform([1 << 18])
    reps = 5 if smoke else 30 if quick else 200
    off = statistics.median(timed(lambda: hvd.allreduce(mib, op=hvd.Sum), comm) for _ in range(reps))
    path = hvd.broadcast_object(os.path.join(tempfile.mkdtemp(), "trace.json"), root_rank=0)
    hvd.start_timeline(path)
    on = statistics.median(timed(lambda: hvd.allreduce(mib, op=hvd.Sum), comm) for _ in range(reps))
    hvd.stop_timeline()
    results["overheads"] = {"check_s": check_s, "allreduce_1mib_s": off, "allreduce_1mib_timeline_s": on}

    if hvd.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=2)
    hvd.shutdown()


if __name__ == "__main__":
    main()
