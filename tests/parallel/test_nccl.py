"""The NCCL path for GPU tensors (hvd_notebook.runtime.nccl_backend), under mpiexec.

On a machine without GPUs: the bootstrap through MPI up to the point where NCCL
would start, and proof that nothing of CUDA is imported. With one GPU per rank
(CUDA_VISIBLE_DEVICES listing them, cupy installed by the [gpu] extra): every
collective on GPU tensors, eager and in tf.function, through NCCL.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from hvd_notebook.runtime import nccl_backend

gpu = pytest.mark.gpu


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
    assert hvd.nccl_built() == nccl_backend.cupy_importable()
    hvd.allreduce(np.ones(3), op=hvd.Sum)
    assert "cupy" not in sys.modules


def test_cuda_visible_devices_minus_one_means_no_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert not nccl_backend.gpu_device_present()


def _need_nccl(hvd):
    if not hvd.nccl_enabled():
        pytest.skip("needs one NVIDIA GPU per rank and cupy (pip install '.[gpu]'); "
                    "benchmarks/gpu_check.sh runs the GPU path on a single GPU")


@gpu
def test_allreduce_on_gpu_every_dtype_and_op(hvd, tf):
    _need_nccl(hvd)
    contributions = np.stack([np.arange(6).reshape(2, 3) + r + 1 for r in range(hvd.size())]).astype(np.float64)
    expected = {"Sum": contributions.sum(0), "Average": contributions.mean(0), "Min": contributions.min(0),
                "Max": contributions.max(0), "Product": contributions.prod(0)}
    failures = []
    for dtype in ("float16", "bfloat16", "float32", "float64", "int32", "int64"):
        with tf.device("/GPU:0"):
            x = tf.cast(tf.reshape(tf.range(6), [2, 3]) + hvd.rank() + 1, dtype)
        for op in expected:
            def reduce(t, op=op):
                return hvd.allreduce(t, op=getattr(hvd, op))

            for mode, fn in (("eager", reduce), ("graph", tf.function(reduce, jit_compile=False))):
                out = fn(x)
                got = tf.cast(out, tf.float64).numpy()
                if "GPU" not in out.device or not np.allclose(got, expected[op], rtol=1e-2):
                    failures.append(f"{dtype} {op} {mode}: {got.tolist()} on {out.device}")
    assert not failures, failures


@gpu
def test_grouped_allgather_broadcast_reducescatter_on_gpu(hvd, tf, tmp_path):
    _need_nccl(hvd)
    path = hvd.broadcast_object(str(tmp_path / "trace.json"), root_rank=0)
    hvd.start_timeline(path)
    with tf.device("/GPU:0"):
        parts = [tf.fill([4, 2], float(hvd.rank() + i)) for i in range(5)]
        rows = tf.fill([hvd.rank() + 1, 3], hvd.rank())
        root = tf.fill([3], 10.0 * (hvd.rank() + 1))
        block = tf.ones([hvd.size() * 2 + 1, 2])
    summed = hvd.grouped_allreduce(parts, op=hvd.Sum)
    gathered = hvd.allgather(rows)
    bcast = hvd.broadcast(root, root_rank=0)
    scattered = hvd.reducescatter(block, op=hvd.Sum)
    hvd.stop_timeline()
    n = hvd.size()
    for i, s in enumerate(summed):
        np.testing.assert_allclose(s.numpy(), np.full([4, 2], sum(r + i for r in range(n))))
    assert gathered.shape[0] == sum(r + 1 for r in range(n))
    np.testing.assert_allclose(bcast.numpy(), np.full([3], 10.0))
    assert scattered.shape[0] == (3 if hvd.rank() == 0 else 2) and float(scattered.numpy().max()) == n
    if hvd.rank() == 0:
        trace = json.dumps(json.load(open(path)))
        for phase in ("NCCL_ALLREDUCE", "NCCL_ALLGATHER", "NCCL_BROADCAST", "NCCL_REDUCESCATTER"):
            assert phase in trace
