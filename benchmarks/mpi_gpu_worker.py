"""Runs inside `mpiexec -n 1` for bench_gpu.py, on one GPU: hvd.allreduce of a GPU tensor against a raw
NCCL allreduce through cupy on a buffer of the same size, and a small CNN's training rate with
DistributedOptimizer against the plain optimizer. Writes JSON.

    CUDA_VISIBLE_DEVICES=0 mpiexec -n 1 python benchmarks/mpi_gpu_worker.py OUT.json [--quick]

Correctness is not checked here: that is `pytest -m gpu` (tests/parallel/test_nccl.py).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import cupy as cp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from cupy.cuda import nccl  # noqa: E402

import hvd_notebook.runtime as hvd  # noqa: E402

MIB = 1 << 20
# buffer size -> timed repetitions (each after 2 untimed warm-ups)
SIZES = {MIB: 30, 4 * MIB: 30, 16 * MIB: 20, 64 * MIB: 10, 256 * MIB: 5, 1024 * MIB: 3}
QUICK_SIZES = {MIB: 10, 16 * MIB: 5}
BATCH = 256


def sync() -> None:
    """Wait for TensorFlow's streams and every stream of the device (the runtime's NCCL stream too)."""
    tf.test.experimental.sync_devices()
    cp.cuda.runtime.deviceSynchronize()


def timed(fn: Callable[[], Any]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def one_size(comm: Any, stream: Any, nbytes: int, reps: int) -> dict[str, Any]:
    """Median seconds of hvd's allreduce and of the raw NCCL call, interleaved so that drift hits both."""
    n = nbytes // 4
    with tf.device("/GPU:0"):
        t = tf.fill([n], tf.constant(1.0, tf.float32))
    send = cp.asarray(np.ones(n, np.float32))  # a copy from the host: no cupy kernel to compile
    recv = cp.empty_like(send)

    def raw() -> None:
        comm.allReduce(send.data.ptr, recv.data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
        stream.synchronize()

    def ours() -> None:
        hvd.allreduce(t, op=hvd.Sum)

    for _ in range(2):  # warm-up: the first call's allocations
        timed(ours)
        timed(raw)
    hvd_s, raw_s = [], []
    for _ in range(reps):
        hvd_s.append(timed(ours))
        raw_s.append(timed(raw))
    return {"reps": reps, "hvd_s": statistics.median(hvd_s), "raw_nccl_s": statistics.median(raw_s)}


def bandwidth(quick: bool) -> dict[str, Any]:
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    stream = cp.cuda.Stream(non_blocking=True)
    result: dict[str, Any] = {"sync_s": statistics.median(timed(lambda: None) for _ in range(20)), "sizes": {}}
    try:
        for nbytes, reps in (QUICK_SIZES if quick else SIZES).items():
            if cp.cuda.runtime.memGetInfo()[0] < 6 * nbytes + (1 << 30):  # hvd's buffers and cupy's two
                result.setdefault("skipped", []).append(nbytes)
                continue
            result["sizes"][str(nbytes)] = one_size(comm, stream, nbytes, reps)
            cp.get_default_memory_pool().free_all_blocks()
    finally:
        comm.destroy()
    return result


def training(quick: bool) -> dict[str, Any]:
    """Samples/s of a small CNN with DistributedOptimizer and with the plain optimizer, after a warm-up epoch."""
    n, epochs = (2048, 1) if quick else (8192, 2)
    rng = np.random.default_rng(0)
    x = rng.random((n, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    result: dict[str, Any] = {"samples": n, "batch": BATCH, "epochs": epochs}
    for kind in ("distributed", "plain"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(10, activation="softmax"),
        ])
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        # XLA cannot compile the collectives (they run outside TensorFlow's kernels); the plain model
        # is compiled the same way so that the two rates compare like with like
        model.compile(optimizer=hvd.DistributedOptimizer(opt) if kind == "distributed" else opt,
                      loss="sparse_categorical_crossentropy", jit_compile=False)
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # tracing, cuDNN's autotuning
        seconds = timed(lambda m=model: m.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0))
        result[f"{kind}_samples_per_s"] = n * epochs / seconds
    return result


def main() -> None:
    out_path, quick = sys.argv[1], "--quick" in sys.argv
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        sys.exit("no GPU visible to TensorFlow (tensorflow-cpu installed, or CUDA_VISIBLE_DEVICES empty?)")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)  # leave room for cupy's buffers
    hvd.init()
    if hvd.size() != 1 or not hvd.nccl_enabled():
        sys.exit(f"run as one rank with NCCL (size {hvd.size()}, NCCL enabled: {hvd.nccl_enabled()})")
    code = nccl.get_version()
    result = {
        "gpu": tf.config.experimental.get_device_details(gpus[0]).get("device_name"),
        "tensorflow": tf.__version__, "cupy": cp.__version__,
        "nccl": f"{code // 10000}.{code % 10000 // 100}.{code % 100}",
        "bandwidth": bandwidth(quick), "training": training(quick),
    }
    hvd.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
