"""The NCCL path for TensorFlow's GPU tensors, under mpiexec (the backend itself, ``array_backend`` on cupy and
NCCL, is tested on both of its seams in test_array_backend.py, on the lent GPU too).

On a machine without GPUs: the bootstrap through MPI up to the point where NCCL would start, and proof
that nothing of CUDA is imported; the ``gpu`` tests skip, saying why. With one GPU per rank
(CUDA_VISIBLE_DEVICES listing them, cupy installed by the [gpu] extra): every collective on GPU tensors,
eager and in tf.function, through NCCL, checked for values, dtypes, the device of the result and the
timeline's NCCL phases. ``benchmarks/gpu_check.sh`` runs the ``gpu`` tests on a one-GPU machine where
TensorFlow imports (never on the lent GPU machine: no TensorFlow wheel fits what reaches it):

    HVD_PARALLEL=1 HVD_PARALLEL_MIN_RANKS=1 HVD_PARALLEL_REQUIRE_NCCL=1 CUDA_VISIBLE_DEVICES=0 \\
        mpiexec -n 1 python -m pytest -m gpu tests/parallel/test_nccl.py
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from hvd_notebook import config
from hvd_notebook.runtime.core import nccl_backend

gpu = pytest.mark.gpu

OPS = ("Sum", "Average", "Min", "Max", "Product")
MODES = ("eager", "graph")


def test_unique_id_made_on_rank_0_reaches_every_rank(hvd):
    # NCCL's unique id is 128 signed chars (cupy returns them as a tuple); any bytes will do here
    made = []

    def make_id():
        made.append(tuple(int(b) - 128 for b in os.urandom(128)))
        return made[-1]

    uid = nccl_backend.bootstrap_unique_id(hvd.communicator(), make_id)
    assert len(made) == (1 if hvd.rank() == 0 else 0), "only rank 0 makes the id"
    every = hvd.allgather_object(uid)
    assert all(u == every[0] for u in every) and len(every[0]) == 128
    if hvd.rank() == 0:
        assert uid == made[0]


def test_without_a_gpu_nothing_of_cuda_is_imported(hvd):
    if nccl_backend.gpu_device_present():
        pytest.skip("this host has an NVIDIA device: the CPU-only guarantee is checked on machines without one")
    assert not hvd.nccl_enabled()
    assert hvd.nccl_built() == nccl_backend.nccl_importable()
    hvd.allreduce(np.ones(3), op=hvd.Sum)
    assert "cupy" not in sys.modules


def test_cuda_visible_devices_minus_one_means_no_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert not nccl_backend.gpu_device_present()


# ------------------------------------------------------------------ helpers of the GPU tests
@pytest.fixture
def nccl(hvd):
    """``hvd`` where every rank reduces GPU tensors with NCCL; elsewhere a skip with the reason, or a
    failure where HVD_PARALLEL_REQUIRE_NCCL=1 (gpu_check.sh: a check that skips everything proves nothing)."""
    if not hvd.nccl_enabled():
        why = ("needs one NVIDIA GPU per rank and cupy (pip install '.[gpu]'); benchmarks/gpu_check.sh runs "
               "these tests on a one-GPU machine")
        if os.environ.get("HVD_PARALLEL_REQUIRE_NCCL") == "1":
            pytest.fail(f"NCCL is not enabled: {why}")
        pytest.skip(why)
    return hvd


@dataclass
class Trace:
    """Rank 0's track of a timeline: how often each phase ran, and the bytes each was given."""

    counts: Counter = field(default_factory=Counter)
    nbytes: dict[str, list[int]] = field(default_factory=dict)


@contextlib.contextmanager
def recorded(hvd: Any, tmp_path: Any) -> Iterator[Trace]:
    """The timeline of the ``with`` block, read by rank 0 and handed to every rank (so that all ranks
    pass or fail the same asserts)."""
    path = hvd.broadcast_object(str(tmp_path / "trace.json"), root_rank=0)
    trace = Trace()
    hvd.start_timeline(path)
    try:
        yield trace
    finally:
        hvd.stop_timeline()
    events = []
    if hvd.rank() == 0:
        events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X" and e.get("pid") == 0]
    for e in hvd.broadcast_object(events, root_rank=0):
        trace.counts[e["name"]] += 1
        trace.nbytes.setdefault(e["name"], []).append(e["args"]["bytes"])


def gpu_tensor(tf: Any, values: np.ndarray, dtype: str) -> Any:
    """``values`` as a ``dtype`` tensor in GPU memory (a tf.constant alone stays in host memory)."""
    with tf.device("/GPU:0"):
        return tf.identity(tf.cast(tf.constant(values, tf.float32), getattr(tf, dtype)))


def contribution(shape: tuple[int, ...], rank: int) -> np.ndarray:
    """Small whole numbers, different on each rank, exact in every dtype (bfloat16 too)."""
    return (np.arange(math.prod(shape)) % 4 + rank + 1).reshape(shape).astype(np.float64)


def reduced(op: str, shape: tuple[int, ...], size: int) -> np.ndarray:
    stacked = np.stack([contribution(shape, r) for r in range(size)])
    return {"Sum": stacked.sum(0), "Average": stacked.mean(0), "Min": stacked.min(0), "Max": stacked.max(0),
            "Product": stacked.prod(0)}[op]


def run(tf: Any, mode: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` eagerly or in a fresh tf.function (no XLA: the collectives run outside TF's kernels)."""
    if mode == "graph":
        fn = tf.function(fn, jit_compile=False, autograph=False)
    with tf.device("/GPU:0"):
        return fn(*args)


def problems(out: Any, want: np.ndarray, dtype: str, label: str) -> list[str]:
    """What is wrong with one result: its device, its memory, its dtype, its values."""
    found = []
    if "GPU" not in out.device.upper():
        found.append(f"{label}: result on {out.device}")
    # TensorFlow keeps int32 tensors in host memory even where their device is a GPU
    if out.dtype.name != "int32" and "GPU" not in out.backing_device.upper():
        found.append(f"{label}: result's memory on {out.backing_device} (a host round trip)")
    if out.dtype.name != dtype:
        found.append(f"{label}: dtype {out.dtype.name}, expected {dtype}")
    got = np.asarray(out.numpy()).astype(np.float64)
    rtol = 1e-2 if dtype in ("float16", "bfloat16") else 1e-6
    if got.shape != want.shape or not np.allclose(got, want, rtol=rtol):
        found.append(f"{label}: {got.tolist()}, expected {want.tolist()}")
    return found


def allreduce_table(hvd: Any, tf: Any, tmp_path: Any, dtype: str, mode: str) -> None:
    """Every op on a [2, 3] ``dtype`` GPU tensor, each through NCCL."""
    x = gpu_tensor(tf, contribution((2, 3), hvd.rank()), dtype)
    failures = []
    with recorded(hvd, tmp_path) as trace:
        for op in OPS:
            out = run(tf, mode, lambda t, op=op: hvd.allreduce(t, op=getattr(hvd, op)), x)
            # integers average as TensorFlow's true division does: into float64
            want_dtype = "float64" if op == "Average" and dtype.startswith("int") else dtype
            failures += problems(out, reduced(op, (2, 3), hvd.size()), want_dtype, f"{dtype} {op} {mode}")
    assert not failures, failures
    assert trace.counts["NCCL_ALLREDUCE"] >= len(OPS), trace.counts


# ------------------------------------------------------------------ GPU tests
@gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int64"])
def test_allreduce_on_gpu_every_op(nccl, tf, tmp_path, dtype, mode):
    allreduce_table(nccl, tf, tmp_path, dtype, mode)


@gpu
@pytest.mark.parametrize("shape", [(), (7,), (2, 3, 4)])
def test_allreduce_on_gpu_any_rank(nccl, tf, shape):
    x = gpu_tensor(tf, contribution(shape, nccl.rank()), "float32")
    for mode in MODES:
        out = run(tf, mode, lambda t: nccl.allreduce(t, op=nccl.Sum), x)
        assert not problems(out, reduced("Sum", shape, nccl.size()), "float32", mode)


@gpu
def test_an_op_nccl_cannot_reduce_is_refused_with_horovods_error(nccl, tf):
    """The NCCL backend checks the op at its boundary, as the MPI backend does: Adasum and an unknown op fail
    with the same errors as on the host, not with a KeyError of NCCL's table."""
    x = gpu_tensor(tf, contribution((3,), nccl.rank()), "float32")
    with pytest.raises(NotImplementedError, match="op=hvd.Adasum is not supported"):
        nccl.allreduce(x, op=nccl.Adasum)
    with pytest.raises(ValueError, match="op=42 is not supported; give op=hvd.Average, hvd.Sum"):
        nccl.allreduce(x, op=42)
    assert not problems(nccl.allreduce(x, op=nccl.Sum), reduced("Sum", (3,), nccl.size()), "float32", "after")


@gpu
@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_on_gpu_fused_or_not(nccl, tf, tmp_path, mode):
    # HOROVOD_FUSION_THRESHOLD=0 (gpu_check.sh runs this test so too) reduces one tensor per NCCL call
    hvd = nccl
    shapes = [(i + 1, 3 + i % 4) for i in range(10)]
    xs = [gpu_tensor(tf, contribution(s, hvd.rank()) * (i + 1), "float32") for i, s in enumerate(shapes)]
    with recorded(hvd, tmp_path) as trace:
        outs = run(tf, mode, lambda *ts: hvd.grouped_allreduce(list(ts), op=hvd.Sum), *xs)
    failures = []
    for i, (s, out) in enumerate(zip(shapes, outs)):
        failures += problems(out, reduced("Sum", s, hvd.size()) * (i + 1), "float32", f"tensor {i}")
    assert not failures, failures
    fused = config.FUSION_THRESHOLD.number() > 0
    assert trace.counts["NCCL_ALLREDUCE"] == (1 if fused else len(shapes)), trace.counts
    assert ("MEMCPY_IN_FUSION_BUFFER" in trace.counts) == fused, trace.counts


@gpu
@pytest.mark.parametrize("mode", MODES)
def test_allgather_broadcast_reducescatter_on_gpu(nccl, tf, tmp_path, mode):
    hvd = nccl
    n, r = hvd.size(), hvd.rank()
    rows = gpu_tensor(tf, np.full([r + 1, 3], r), "float32")
    root = gpu_tensor(tf, np.full([3], 10.0 * (r + 1)), "float32")
    block = gpu_tensor(tf, np.ones([n * 2 + 1, 2]) * (r + 1), "float32")
    with recorded(hvd, tmp_path) as trace:
        gathered = run(tf, mode, hvd.allgather, rows)
        bcast = run(tf, mode, lambda t: hvd.broadcast(t, root_rank=0), root)
        summed = run(tf, mode, lambda t: hvd.reducescatter(t, op=hvd.Sum), block)
        averaged = run(tf, mode, lambda t: hvd.reducescatter(t, op=hvd.Average), block)
    # reducescatter splits rows evenly, the first ranks taking one more where they do not divide
    mine = 2 + (1 if r == 0 else 0)
    total = sum(k + 1 for k in range(n))
    failures = problems(gathered, np.concatenate([np.full([k + 1, 3], k) for k in range(n)]), "float32", "allgather")
    failures += problems(bcast, np.full([3], 10.0), "float32", "broadcast")
    failures += problems(summed, np.full([mine, 2], total), "float32", "reducescatter Sum")
    failures += problems(averaged, np.full([mine, 2], total / n), "float32", "reducescatter Average")
    assert not failures, failures
    for phase in ("NCCL_ALLGATHER", "NCCL_BROADCAST", "NCCL_REDUCESCATTER"):
        assert trace.counts[phase], (phase, trace.counts)


@gpu
def test_fp16_compression_sends_half_the_bytes_on_gpu(nccl, tf, tmp_path):
    hvd = nccl
    x = gpu_tensor(tf, contribution((3, 5), hvd.rank()), "float32")
    with recorded(hvd, tmp_path) as trace:
        out = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert not problems(out, reduced("Sum", (3, 5), hvd.size()), "float32", "fp16")
    # 15 float16 values are 30 bytes; in float32 they would be 60
    assert trace.nbytes["NCCL_ALLREDUCE"] and max(trace.nbytes["NCCL_ALLREDUCE"]) < 60, trace.nbytes


@gpu
def test_join_on_gpu(nccl, tf):
    hvd = nccl
    if hvd.size() < 2:
        pytest.skip("join needs two ranks, each with its own GPU")
    found = []
    if hvd.rank() == 0:
        last = hvd.join()
    else:
        x = gpu_tensor(tf, np.full([2, 3], 4.0), "float32")
        contributed = 4.0 * (hvd.size() - 1)  # the joined rank 0 adds zeros
        found += problems(hvd.allreduce(x, op=hvd.Sum), np.full([2, 3], contributed), "float32", "Sum")
        found += problems(hvd.allreduce(x, op=hvd.Average), np.full([2, 3], contributed / hvd.size()), "float32",
                          "Average")
        last = hvd.join()  # before any assert: a rank that raised here would leave rank 0 waiting
    assert not found, found
    assert last == hvd.size() - 1


@gpu
def test_distributed_optimizer_trains_on_gpu(nccl, tf, tmp_path):
    import keras

    hvd = nccl
    keras.utils.set_random_seed(hvd.rank())  # different weights on each rank until the broadcast
    rng = np.random.default_rng(hvd.rank())
    x, y = rng.random((64, 8), dtype=np.float32), rng.random((64, 1), dtype=np.float32)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    # Keras turns XLA on by itself where a GPU is visible; the NCCL calls run outside TensorFlow's kernels
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse", jit_compile=False)
    with recorded(hvd, tmp_path) as trace:
        history = model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                            callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    weight = model.trainable_weights[0]
    assert "GPU" in str(getattr(weight, "value", weight).device).upper()
    assert math.isfinite(history.history["loss"][-1])
    assert trace.counts["NCCL_ALLREDUCE"] >= 4, trace.counts  # one fused gradient allreduce per step at least
    checksums = hvd.allgather_object(float(sum(np.sum(w.numpy()) for w in model.weights)))
    np.testing.assert_allclose(checksums, checksums[0], rtol=1e-6)  # every rank ends with the same weights


# runs last: TensorFlow keeps int32 tensors in host memory even where their device is a GPU and exports
# them through DLPack as CPU memory; a path that gave that memory to NCCL as device memory could break
# the CUDA context for every test after it
@gpu
@pytest.mark.parametrize("mode", MODES)
def test_allreduce_on_gpu_int32(nccl, tf, tmp_path, mode):
    allreduce_table(nccl, tf, tmp_path, "int32", mode)
