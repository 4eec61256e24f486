"""Runs inside `mpiexec -n 2` for bench_elastic.py: the cost of ``hvd.elastic`` commits on a Keras model of
25 M float32 parameters with Adam (its two slots each as large), and of the training step right after a
commit, whose first write to each variable copies it (rank 0 writes JSON).

    mpiexec -n 2 python benchmarks/mpi_elastic_worker.py OUT.json [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_notebook.runtime as hvd  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

WIDTH = 5000  # one Dense layer of 5000 x 5000 (+ bias): 25.005 M parameters


def main() -> None:
    out_path, quick = sys.argv[1], "--quick" in sys.argv
    width = WIDTH // 5 if quick else WIDTH  # (--quick: 1 M parameters, a smoke run)
    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(width)])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-4))
    x = np.random.default_rng(hvd.rank()).random((8, width), dtype=np.float32)

    @tf.function
    def step() -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    state = hvd.elastic.KerasState(model, optimizer, epoch=0, batch=0)
    state.sync()
    step()
    reps = 3 if quick else 10
    commit, plain_step, step_after_commit = [], [], []
    for i in range(reps):
        hvd.barrier()
        t0 = time.perf_counter()
        step()
        plain_step.append(time.perf_counter() - t0)
        state.batch = i
        hvd.barrier()
        t0 = time.perf_counter()
        state.commit()
        commit.append(time.perf_counter() - t0)
        hvd.barrier()
        t0 = time.perf_counter()
        step()  # its writes copy each variable that the commit shares
        step_after_commit.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    state.restore()
    restore = time.perf_counter() - t0
    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    committed = parameters + sum(int(np.prod(v.shape)) for v in optimizer.variables)
    if hvd.rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"parameters": parameters, "committed_values": committed,
                       "commit_s": statistics.median(commit), "step_s": statistics.median(plain_step),
                       "step_after_commit_s": statistics.median(step_after_commit), "restore_s": restore,
                       "reps": reps}, f, indent=2)
    hvd.shutdown()


if __name__ == "__main__":
    main()
