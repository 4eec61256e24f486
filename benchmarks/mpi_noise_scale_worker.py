"""Runs inside `mpiexec -n 2` for bench_noise_scale.py: the same training step with the gradient noise
scale measured and not, in alternating rounds, for Keras (``fit`` with DistributedOptimizer) and PyTorch
(DistributedOptimizer); rank 0 writes the seconds per step as JSON.

    mpiexec -n 2 python benchmarks/mpi_noise_scale_worker.py OUT.json [--quick]
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
import torch  # noqa: E402

import hvd_notebook.runtime as hvd  # noqa: E402
import hvd_notebook.runtime.torch as thvd  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
torch.set_num_threads(1)

BATCH = 64


def measuring(on: bool) -> None:
    """The setting is read where an optimizer decides (Keras: when its step is traced; torch: when made)."""
    os.environ["HVD_NOTEBOOK_NOISE_SCALE"] = "1" if on else "0"


def keras_model(on: bool) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((28, 28, 1)), keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(), keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
                  loss="sparse_categorical_crossentropy")
    model.noise_on = on
    return model


def keras_step_s(model: keras.Model, x: np.ndarray, y: np.ndarray) -> float:
    measuring(model.noise_on)  # (read when fit traces its step: the first time)
    hvd.barrier()
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    hvd.barrier()
    return (time.perf_counter() - t0) / (len(x) // BATCH)


def torch_setup(on: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    measuring(on)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Conv2d(16, 32, 3),
        torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(32 * 5 * 5, 64),
        torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = thvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                    named_parameters=model.named_parameters())
    return model, opt


def torch_step_s(setup: tuple, x: torch.Tensor, y: torch.Tensor) -> float:
    model, opt = setup
    steps = len(x) // BATCH
    hvd.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[i * BATCH:(i + 1) * BATCH]), y[i * BATCH:(i + 1) * BATCH])
        loss.backward()
        opt.step()
    hvd.barrier()
    return (time.perf_counter() - t0) / steps


def alternate(measure, on, off, rounds: int) -> dict:
    """Median seconds per step of each, measured in alternating rounds (after one warm-up each), which goes
    first alternating too."""
    measure(on), measure(off)
    times = {"on": [], "off": []}
    for i in range(rounds):
        for key, what in (("on", on), ("off", off))[:: 1 if i % 2 else -1]:
            times[key].append(measure(what))
    return {k: statistics.median(v) for k, v in times.items()} | {"rounds": rounds}


def main() -> None:
    out_path, quick = sys.argv[1], "--quick" in sys.argv
    hvd.init()
    thvd.init()
    rng = np.random.default_rng(hvd.rank())
    n = BATCH * (8 if quick else 40)
    x = rng.random((n, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, n)
    rounds = 1 if quick else 9
    keras_on, keras_off = keras_model(True), keras_model(False)
    result = {"ranks": hvd.size(), "batch": BATCH, "steps_per_round": n // BATCH,
              "keras": alternate(lambda m: keras_step_s(m, x, y), keras_on, keras_off, rounds)}
    result["keras"]["noise_scale"] = keras_on.optimizer.noise_scale()
    result["keras"]["steps_measured"] = (keras_on.optimizer._hvd_noise.steps, keras_off.optimizer._hvd_noise.steps)
    # a torch step is shorter and noisier on this VM: three times the steps a round
    tx = torch.from_numpy(np.concatenate([x] * 3)).permute(0, 3, 1, 2).contiguous()
    ty = torch.from_numpy(np.concatenate([y] * 3))
    torch_on, torch_off = torch_setup(True), torch_setup(False)
    result["torch"] = alternate(lambda s: torch_step_s(s, tx, ty), torch_on, torch_off, rounds)
    result["torch"]["noise_scale"] = torch_on[1].noise_scale(BATCH)
    result["torch"]["steps_measured"] = (torch_on[1]._noise.estimator.steps, torch_off[1]._noise.estimator.steps)
    if hvd.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
