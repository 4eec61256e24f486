"""Timing helpers of the workers that run under mpiexec (mpi_allreduce_worker.py, mpi_torch_worker.py):
each timed call starts after a barrier, ours and the baseline interleaved so that drift hits both alike."""

from __future__ import annotations

import statistics
import time


def timed(fn, comm) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_pair(ours, raw, reps: int, comm) -> tuple[float, float]:
    """Interleave the two so drift hits both alike; return medians in seconds."""
    for _ in range(max(2, reps // 10)):  # warm-up
        ours(), raw()
    a, b = [], []
    for _ in range(reps):
        a.append(timed(ours, comm))
        b.append(timed(raw, comm))
    return statistics.median(a), statistics.median(b)


def median_blocks(ours, raw, blocks: int, per_block: int, comm) -> tuple[float, float]:
    """Alternate blocks of calls instead of single calls: each side then runs
    with its own buffers in the caches, as a training step's allreduce would."""
    a, b = [], []
    for _ in range(blocks):
        a += [timed(ours, comm) for _ in range(per_block)]
        b += [timed(raw, comm) for _ in range(per_block)]
    return statistics.median(a), statistics.median(b)


def best_back_to_back(fn, calls: int, trials: int, comm) -> float:
    """Seconds per call of ``calls`` calls in a row with no barrier between them (as a training
    loop issues them, ranks a little apart), best of ``trials`` (one barrier before each trial)."""
    fn()
    best = float("inf")
    for _ in range(trials):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best
