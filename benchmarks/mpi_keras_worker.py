"""Runs inside `mpiexec -n N` for bench_keras.py: trains a small CNN on synthetic
28x28 images with one thread per rank and reports samples/s (rank 0 writes JSON).
`tf.keras`: Keras 3, or Keras 2 (tf_keras) where TF_USE_LEGACY_KERAS=1.

    mpiexec -n 1 python benchmarks/mpi_keras_worker.py OUT.json [--quick]   # also times the plain optimizer
    mpiexec -n 2 python benchmarks/mpi_keras_worker.py OUT.json [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = tf.keras  # (Keras 3's own API, or tf_keras under TF_USE_LEGACY_KERAS=1)

import hvd_notebook.runtime as hvd  # noqa: E402
from hvd_notebook import keras_flavour  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

PER_RANK_BATCH = 64


def build(distributed: bool) -> tf.keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    model.compile(hvd.DistributedOptimizer(opt) if distributed else opt, loss="sparse_categorical_crossentropy")
    return model


def samples_per_s(model: tf.keras.Model, x: np.ndarray, y: np.ndarray, epochs: int) -> float:
    model.fit(x, y, batch_size=PER_RANK_BATCH, epochs=1, verbose=0)  # trace and warm up
    hvd.barrier()
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=PER_RANK_BATCH, epochs=epochs, verbose=0)
    hvd.barrier()
    return len(x) * epochs * hvd.size() / (time.perf_counter() - t0)


def main() -> None:
    out_path, quick = sys.argv[1], "--quick" in sys.argv
    hvd.init()
    rng = np.random.default_rng(hvd.rank())
    n = 512 if quick else 4096
    x = rng.random((n, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, n)
    epochs = 1 if quick else 2
    result: dict = {"ranks": hvd.size(), "per_rank_batch": PER_RANK_BATCH, "samples_per_rank_epoch": n,
                    "keras": keras_flavour.label()}
    distributed = build(True)
    if hvd.size() == 1:  # the wrapper's own cost: alternate plain and wrapped
        plain = build(False)
        pairs = [(samples_per_s(plain, x, y, epochs), samples_per_s(distributed, x, y, epochs))
                 for _ in range(1 if quick else 5)]
        result["plain"] = statistics.median(p for p, _ in pairs)
        result["distributed"] = statistics.median(d for _, d in pairs)
    else:
        result["distributed"] = samples_per_s(distributed, x, y, epochs)
        # the machine's own ceiling: the same ranks training independently (no gradient exchange)
        result["independent"] = samples_per_s(build(False), x, y, epochs)
    if hvd.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
