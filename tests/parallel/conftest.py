"""Tests in this folder run inside an MPI world: `HVD_PARALLEL=1 mpiexec -n 2 python -m pytest
tests/parallel` (tests/integration/test_parallel.py does that). Every rank runs the same
tests in the same order, so their collectives meet. HVD_PARALLEL_MIN_RANKS=1 allows a
one-rank world, for the `gpu` tests on a machine with one GPU (benchmarks/gpu_check.sh)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")


@pytest.fixture(scope="session")
def hvd():
    import hvd_notebook.runtime as hvd

    hvd.init()
    minimum = int(os.environ.get("HVD_PARALLEL_MIN_RANKS", "2"))
    assert hvd.size() >= minimum, f"run these tests with mpiexec -n {max(minimum, 2)}"
    yield hvd
    hvd.shutdown()


@pytest.fixture(scope="session")
def tf():
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return tf
