"""The array backend (runtime/core/array_backend.py), the one implementation of GPU collectives for cupy
arrays and TensorFlow's GPU tensors, under mpiexec, on both of its pairs of seams:

- ``host``: numpy and an mpi4py transport of NCCL's equal-block collectives, on every machine (here);
- ``gpu``: cupy and NCCL, the world's own NCCL backend's device and transport, where every rank has a GPU
  (skipped here with the reason; ``benchmarks/gpu_check.sh`` runs them on a lent GPU:
  ``mpiexec -n 1 python -m pytest -m gpu tests/parallel/test_array_backend.py``).

Each test counts the transport's calls (a fused round makes one) and, on the host, the array module's
``concatenate`` calls (one per packed buffer).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest

from hvd_notebook.runtime.core import ops
from hvd_notebook.runtime.core.array_backend import ArrayBackend
from hvd_notebook.runtime.core.exceptions import MismatchError
from hvd_notebook.runtime.core.transports import HostDevice, MpiTransport

SEAMS = ["host", pytest.param("gpu", marks=pytest.mark.gpu)]
NO_GPU = ("needs one NVIDIA GPU per rank and cupy (pip install '.[gpu]'); benchmarks/gpu_check.sh runs these "
          "tests on a one-GPU machine")


class Counting:
    """A transport that records each call (its name, dtype and elements) and passes it on."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, []
        self.via, self.phase, self.size, self.rank = inner.via, inner.phase, inner.size, inner.rank
        self.array_dtype, self.work_dtype, self.refusal = inner.array_dtype, inner.work_dtype, inner.refusal

    def _record(self, name: str, buf: Any) -> None:
        self.calls.append((name, np.dtype(buf.dtype).name, int(buf.size)))

    def allreduce(self, send: Any, recv: Any, op: int) -> None:
        self._record("allreduce", recv)
        self.inner.allreduce(send, recv, op)

    def allgather(self, send: Any, recv: Any) -> None:
        self._record("allgather", send)
        self.inner.allgather(send, recv)

    def broadcast(self, buf: Any, root: int) -> None:
        self._record("broadcast", buf)
        self.inner.broadcast(buf, root)

    def reduce_scatter(self, send: Any, recv: Any, op: int) -> None:
        self._record("reduce_scatter", send)
        self.inner.reduce_scatter(send, recv, op)

    def alltoall(self, send: Any, recv: Any) -> None:
        self._record("alltoall", send)
        self.inner.alltoall(send, recv)

    def free(self) -> None:
        self.inner.free()

    def kinds(self) -> Counter:
        return Counter(name for name, _, _ in self.calls)


class CountingModule:
    """An array module whose ``concatenate`` calls are counted."""

    def __init__(self, xp: Any) -> None:
        self.xp, self.concatenates = xp, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.xp, name)

    def concatenate(self, *args: Any, **kwargs: Any) -> Any:
        self.concatenates += 1
        return self.xp.concatenate(*args, **kwargs)


class CountingHostDevice(HostDevice):
    def __init__(self) -> None:
        self.xp = CountingModule(np)


@pytest.fixture(scope="module")
def host_backend(hvd):
    """numpy over its own mpi4py transport, agreeing through the world's negotiator (as the GPU's does),
    serving the world's join."""
    from hvd_notebook.runtime.core import world

    w = world.current()
    transport = Counting(MpiTransport(w.comm.Dup()))
    backend = ArrayBackend(w.comm, w.negotiator, w.timeline, CountingHostDevice(), transport)
    w.serving[transport.via] = backend
    yield backend
    del w.serving[transport.via]
    backend.free()


@pytest.fixture
def backend(seam, hvd, host_backend):
    """The backend on the test's pair of seams (its ``seam`` parameter), its transport's calls cleared."""
    from hvd_notebook.runtime.core import world

    if seam == "host":
        chosen = host_backend
    else:
        nccl = world.current().nccl
        if nccl is None:  # (gpu_check.sh sets HVD_PARALLEL_REQUIRE_NCCL=1: a check that skips all proves nothing)
            (pytest.fail if os.environ.get("HVD_PARALLEL_REQUIRE_NCCL") == "1" else pytest.skip)(NO_GPU)
        chosen = ArrayBackend(nccl.comm, nccl.negotiator, nccl.timeline, nccl.device, Counting(nccl.transport))
    chosen.transport.calls.clear()
    return chosen


def two_ranks(backend: ArrayBackend) -> None:
    """Skip where one rank runs (the lent GPU): the test pairs two ranks' different calls."""
    if backend.size < 2:
        pytest.skip("needs two ranks (one GPU each)")


def host(array: Any) -> np.ndarray:
    """A result in host memory (cupy's ``get``)."""
    return array.get() if hasattr(array, "get") else np.asarray(array)


def contribution(shape: tuple[int, ...], rank: int, dtype: Any = np.float32) -> np.ndarray:
    """Small whole numbers, different on each rank, exact in every dtype."""
    return ((np.arange(int(np.prod(shape))) % 4 + rank + 1).reshape(shape)).astype(dtype)


def expected(op: int, shape: tuple[int, ...], size: int) -> np.ndarray:
    stacked = np.stack([contribution(shape, r, np.float64) for r in range(size)])
    return {ops.Sum: stacked.sum(0), ops.Average: stacked.mean(0), ops.Min: stacked.min(0),
            ops.Max: stacked.max(0), ops.Product: stacked.prod(0)}[op]


# ------------------------------------------------------------------ allreduce
@pytest.mark.parametrize("seam", SEAMS)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
def test_allreduce_every_op_one_transport_call_each(backend, seam, dtype):
    xp, n = backend.xp, backend.size
    for op in (ops.Sum, ops.Average, ops.Min, ops.Max, ops.Product):
        x = xp.asarray(contribution((2, 3), backend.rank, dtype))
        (out,) = backend.allreduce([x], op, 1.0, 1.0, [f"{dtype}.{op}"])
        want = expected(op, (2, 3), n)
        if op == ops.Average and dtype.startswith("int"):
            want = np.trunc(want)  # (Horovod's integer average: truncated, in the integers' dtype)
        assert out.dtype == x.dtype and out.shape == (2, 3)
        np.testing.assert_allclose(host(out), want, rtol=1e-3)
        np.testing.assert_array_equal(host(x), contribution((2, 3), backend.rank, dtype))  # the input untouched
    assert backend.transport.kinds() == {"allreduce": 5}, backend.transport.calls


@pytest.mark.parametrize("seam", SEAMS)
def test_half_precision_reduced_as_the_transport_needs(backend, seam):
    """float16 travels as float32 over MPI (which has no half type) and as float16 over NCCL; either way one
    call, and the result is float16."""
    xp = backend.xp
    x = xp.asarray(contribution((5,), backend.rank, np.float16))
    (out,) = backend.allreduce([x], ops.Sum, 1.0, 1.0, ["half"])
    assert out.dtype == np.float16
    np.testing.assert_allclose(host(out), expected(ops.Sum, (5,), backend.size))
    ((_, sent, elements),) = backend.transport.calls
    assert sent == backend.transport.work_dtype(np.dtype(np.float16)).name and elements == 5


def test_bfloat16_reduced_as_float32_on_the_host(host_backend):
    """(cupy has no bfloat16: on a GPU the TensorFlow binding widens it before the backend sees it.)"""
    import ml_dtypes

    host_backend.transport.calls.clear()
    x = contribution((2, 3), host_backend.rank, ml_dtypes.bfloat16)
    (out,) = host_backend.allreduce([x], ops.Average, 1.0, 1.0, ["bf16"])
    assert out.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_allclose(out.astype(np.float64), expected(ops.Average, (2, 3), host_backend.size))
    assert [c[1] for c in host_backend.transport.calls] == ["float32"]


@pytest.mark.parametrize("seam", SEAMS)
def test_prescale_and_postscale(backend, seam):
    x = backend.xp.asarray(contribution((4,), backend.rank))
    (out,) = backend.allreduce([x], ops.Sum, 2.0, 0.5, ["scaled"])
    np.testing.assert_allclose(host(out), expected(ops.Sum, (4,), backend.size))


@pytest.mark.parametrize("seam", SEAMS)
def test_a_grouped_call_is_one_concatenate_and_one_transport_call(backend, seam, monkeypatch):
    xp, n = backend.xp, backend.size
    shapes = [(i + 1, 3 + i % 4) for i in range(10)]
    xs = [xp.asarray(contribution(s, backend.rank) * (i + 1)) for i, s in enumerate(shapes)]
    before = getattr(xp, "concatenates", 0)
    outs = backend.allreduce(xs, ops.Sum, 1.0, 1.0, [f"g{i}" for i in range(10)])
    for i, (s, out) in enumerate(zip(shapes, outs)):
        assert out.shape == s
        np.testing.assert_allclose(host(out), expected(ops.Sum, s, n) * (i + 1))
    assert backend.transport.kinds() == {"allreduce": 1}, backend.transport.calls
    if hasattr(xp, "concatenates"):
        assert xp.concatenates - before == 1
    # without fusion (HOROVOD_FUSION_THRESHOLD=0), one call per array
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
    backend.transport.calls.clear()
    outs = backend.allreduce(xs, ops.Sum, 1.0, 1.0, [f"u{i}" for i in range(10)])
    np.testing.assert_allclose(host(outs[-1]), expected(ops.Sum, shapes[-1], n) * 10)
    assert backend.transport.kinds() == {"allreduce": 10}, backend.transport.calls


@pytest.mark.parametrize("seam", SEAMS)
def test_allreduces_agreed_in_one_round_share_one_transport_call(backend, seam, monkeypatch, in_threads):
    """Horovod's fusion across calls, through the coordinator's Work: rank 1 waits in a "gate" allreduce
    that rank 0 joins late, so both ranks' six other calls (from six threads, in opposite orders) wait and
    are agreed in one round (HOROVOD_CYCLE_TIME: a round waits that long for more calls)."""
    two_ranks(backend)
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "250")
    xp, r, n = backend.xp, backend.rank, backend.size
    names = [f"layer{i}" for i in range(6)]
    results = {}

    def work(name: str) -> None:
        time.sleep(0.6 if name == "gate" and r == 0 else 0.0 if name == "gate" else 0.1)
        i = names.index(name) if name in names else 10
        (results[name],) = backend.allreduce([xp.full(2000, float(i + r), np.float32)], ops.Sum, 1.0, 1.0, [name])

    assert in_threads(work, ["gate", *(names if r == 0 else names[::-1])]) == {}
    for i, name in enumerate([*names, "gate"]):
        i = 10 if name == "gate" else i
        np.testing.assert_allclose(host(results[name]), np.full(2000, n * i + n * (n - 1) / 2))
    sizes = sorted(elements for _, _, elements in backend.transport.calls)
    # the gate alone, and the six layers in one call (a lone first call of rank 0 may run before the others)
    assert len(sizes) <= 3 and sizes[-1] >= 5 * 2000, sizes


# ------------------------------------------------------------------ the other collectives
@pytest.mark.parametrize("seam", SEAMS)
def test_allgather_uneven_first_dimension_in_one_call(backend, seam):
    xp, r, n = backend.xp, backend.rank, backend.size
    rows = xp.asarray(np.full((r + 1, 3), r, np.float32))
    small = xp.asarray(np.arange(2 * r + 1, dtype=np.int8))
    gathered, smalls = backend.allgather([rows, small], ["rows", "small"])
    np.testing.assert_array_equal(host(gathered), np.concatenate([np.full((k + 1, 3), k) for k in range(n)]))
    np.testing.assert_array_equal(host(smalls), np.concatenate([np.arange(2 * k + 1) for k in range(n)]))
    assert gathered.dtype == np.float32 and smalls.dtype == np.int8
    assert backend.transport.kinds() == {"allgather": 1}


@pytest.mark.parametrize("seam", SEAMS)
def test_broadcast_of_mixed_dtypes_in_one_call(backend, seam):
    xp, r, n = backend.xp, backend.rank, backend.size
    for root in range(n):
        a = xp.asarray(np.full((2, 3), 10.0 * (r + 1), np.float64))
        b = xp.asarray(np.full(5, r + 1, np.int8))
        outs = backend.broadcast([a, b], root, ["a", "b"])
        np.testing.assert_array_equal(host(outs[0]), np.full((2, 3), 10.0 * (root + 1)))
        np.testing.assert_array_equal(host(outs[1]), np.full(5, root + 1))
        assert outs[0].dtype == np.float64 and outs[1].dtype == np.int8 and outs[0].shape == (2, 3)
    assert backend.transport.kinds() == {"broadcast": n}


@pytest.mark.parametrize("seam", SEAMS)
def test_alltoall_with_and_without_splits(backend, seam):
    xp, r, n = backend.xp, backend.rank, backend.size
    # rank r sends s + 1 rows to rank s, each row holding (r, s)
    splits = np.arange(1, n + 1)
    x = xp.asarray(np.concatenate([np.tile([r, s], (s + 1, 1)) for s in range(n)]).astype(np.float32))
    out, received = backend.alltoall(x, splits, "uneven")
    np.testing.assert_array_equal(received, np.full(n, r + 1))
    np.testing.assert_array_equal(host(out), np.concatenate([np.tile([k, r], (r + 1, 1)) for k in range(n)]))
    even, received = backend.alltoall(xp.asarray(np.full((2 * n, 2), r, np.int64)), None, "even")
    np.testing.assert_array_equal(host(even), np.repeat(np.arange(n), 2)[:, None] * np.ones((1, 2)))
    assert backend.transport.kinds() == {"alltoall": 2}


@pytest.mark.parametrize("seam", SEAMS)
def test_reducescatter_uneven_rows(backend, seam):
    xp, r, n = backend.xp, backend.rank, backend.size
    block = xp.asarray(np.ones((2 * n + 1, 2), np.float32) * (r + 1))
    total = n * (n + 1) / 2
    mine = 2 + (1 if r == 0 else 0)  # the first ranks take one more row where they do not divide
    summed, = backend.reducescatter([block], ops.Sum, ["rs"])
    averaged, = backend.reducescatter([block], ops.Average, ["rs.avg"])
    np.testing.assert_allclose(host(summed), np.full((mine, 2), total))
    np.testing.assert_allclose(host(averaged), np.full((mine, 2), total / n))
    assert backend.transport.kinds() == {"reduce_scatter": 2}


# ------------------------------------------------------------------ errors: every rank raises, none hangs
@pytest.mark.parametrize("seam", SEAMS)
def test_mismatched_shapes_or_dtypes_raise_on_every_rank(backend, seam):
    two_ranks(backend)
    xp, r = backend.xp, backend.rank
    with pytest.raises(MismatchError, match="shape"):
        backend.allreduce([xp.ones((2, 3 + r), np.float32)], ops.Sum, 1.0, 1.0, ["shapes"])
    with pytest.raises(MismatchError, match="dtype"):
        backend.allreduce([xp.ones(3, np.float32 if r == 0 else np.float64)], ops.Sum, 1.0, 1.0, ["dtypes"])
    with pytest.raises(MismatchError):
        backend.allgather([xp.ones((2, 2 + r), np.float32)], ["trailing"])
    with pytest.raises(MismatchError):
        backend.broadcast([xp.ones(2 + r, np.float32)], 0, ["bshape"])
    # and the next call works
    (out,) = backend.allreduce([xp.ones(3, np.float32)], ops.Sum, 1.0, 1.0, ["after"])
    np.testing.assert_array_equal(host(out), np.full(3, backend.size))
    assert backend.transport.kinds() == {"allreduce": 1}  # (nothing moved for the refused calls)


@pytest.mark.parametrize("seam", SEAMS)
def test_refusals_raise_on_every_rank_before_any_transport_call(backend, seam):
    two_ranks(backend)
    xp, r, n = backend.xp, backend.rank, backend.size
    x = xp.ones(3, np.float32)
    with pytest.raises(NotImplementedError, match="op=hvd.Adasum is not supported"):
        backend.allreduce([x], ops.Adasum, 1.0, 1.0, ["adasum"])
    with pytest.raises(ValueError, match="op=42 is not supported"):
        backend.allreduce([x], 42, 1.0, 1.0, ["op42"])
    with pytest.raises(ValueError, match="is not a rank" if r == 1 else r"refused on rank\(s\) \[1\]"):
        backend.broadcast([x], n if r == 1 else 0, ["badroot"])
    with pytest.raises(ValueError, match="splits" if r == 0 else r"refused on rank\(s\) \[0\]"):
        backend.alltoall(xp.ones((4, 2), np.float32), [5, 0] if r == 0 else None, "badsplits")
    with pytest.raises(ValueError, match="at least one dimension" if r == 1 else r"refused on rank\(s\) \[1\]"):
        backend.allgather([xp.ones((), np.float32) if r == 1 else xp.ones(1, np.float32)], ["scalar"])
    with pytest.raises(ValueError, match="Adasum"):
        backend.reducescatter([xp.ones((4, 2), np.float32)], ops.Adasum, ["rs.adasum"])
    with pytest.raises(ValueError, match="at least one dimension" if r == 0 else r"refused on rank\(s\) \[0\]"):
        backend.reducescatter([xp.ones((), np.float32) if r == 0 else xp.ones(2, np.float32)], ops.Sum, ["rs.0d"])
    with pytest.raises(ValueError, match="at least one dimension"):
        backend.alltoall(xp.ones((), np.float32), None, "a2a.0d")
    with pytest.raises(ValueError, match="must divide evenly"):
        backend.alltoall(xp.ones((2 * n + 1, 2), np.float32), None, "a2a.uneven")
    assert backend.transport.calls == []


@pytest.mark.parametrize("seam", SEAMS)
def test_a_dtype_the_transport_cannot_reduce_is_refused_on_every_rank(backend, seam, monkeypatch):
    """A transport's own refusal (NCCL has no int16) reaches every rank; here the host transport is made to
    refuse int16 on rank 1 only, as NCCL refuses it everywhere."""
    two_ranks(backend)
    r = backend.rank
    if seam == "host":
        monkeypatch.setattr(backend.transport, "refusal", lambda dtype, reducing: "no int16 here"
                            if reducing and r == 1 and dtype == np.int16 else None)
    x = backend.xp.ones(3, np.int16)
    with pytest.raises(ValueError, match="int16" if r == 1 or seam == "gpu" else r"refused on rank\(s\) \[1\]"):
        backend.allreduce([x], ops.Sum, 1.0, 1.0, ["int16"])
    (moved,) = backend.allgather([x], ["int16.bytes"])  # (bytes travel whatever the dtype)
    np.testing.assert_array_equal(host(moved), np.ones(3 * backend.size))
    assert backend.transport.kinds() == {"allgather": 1}


@pytest.mark.parametrize("seam", SEAMS)
def test_join_serves_the_other_ranks_allreduce_with_zeros(backend, seam, hvd):
    r, n = backend.rank, backend.size
    found = []
    if r == 0:
        last = hvd.join()
    else:
        x = backend.xp.asarray(np.full((2, 3), 4.0, np.float32))
        (summed,) = backend.allreduce([x], ops.Sum, 1.0, 1.0, ["joined.sum"])
        (averaged,) = backend.allreduce([x], ops.Average, 1.0, 1.0, ["joined.avg"])
        found = [host(summed).tolist(), host(averaged).tolist()]
        last = hvd.join()
    contributed = 4.0 * (n - 1)
    if r != 0:
        assert found == [np.full((2, 3), contributed).tolist(), np.full((2, 3), contributed / n).tolist()]
    assert last == n - 1



# ------------------------------------------------------------------ the call context: one entry, one wait
class RecordingDevice(HostDevice):
    """The host device, counting each call's entries and the waits a GPU makes on leaving (``CupyDevice``)."""

    def __init__(self) -> None:
        self.entered = self.left = 0

    @contextlib.contextmanager
    def call(self, order_in: Any) -> Any:
        self.entered += 1
        if order_in is not None:
            order_in()
        yield
        self.left += 1  # (where CupyDevice synchronizes its stream: the call's one host wait)


def test_each_call_enters_the_device_once_however_many_buffers(host_backend):
    device = RecordingDevice()
    backend = ArrayBackend(host_backend.comm, host_backend.negotiator, host_backend.timeline, device,
                           host_backend.transport)
    backend.transport.calls.clear()
    waits = []
    order_in = lambda: waits.append(1)  # noqa: E731
    r = backend.rank
    calls = [
        lambda: backend.allreduce([np.ones(3, np.float32), np.ones(4, np.float64), np.ones(5, np.float32)], ops.Sum,
                                  1.0, 1.0, ["a", "b", "c"], order_in=order_in),
        lambda: backend.allgather([np.ones((r + 1, 2)), np.ones(3, np.int8)], ["g", "h"], order_in=order_in),
        lambda: backend.broadcast([np.ones(2), np.ones(3, np.int8)], 0, ["x", "y"], order_in=order_in),
        lambda: backend.alltoall(np.ones((2 * backend.size, 2)), None, "t", order_in=order_in),
        lambda: backend.reducescatter([np.ones((4, 2)), np.ones((3,))], ops.Sum, ["p", "q"], order_in=order_in),
    ]
    for i, call in enumerate(calls, 1):
        call()
        assert (device.entered, device.left, len(waits)) == (i, i, i)
    # two dtypes: two buffers, two transport calls, one context; the reducescatter's two arrays likewise
    assert backend.transport.kinds() == {"allreduce": 2, "allgather": 1, "broadcast": 1, "alltoall": 1,
                                         "reduce_scatter": 2}


# ------------------------------------------------------------------ TensorFlow's route, on the host seams
def test_tensorflow_tensors_through_the_backend(host_backend, tf):
    """TensorFlow's GPU route (runtime/tensorflow/nccl.py: bfloat16 widened or sent as bits, the dtypes named
    in the agreement, TensorFlow's device sync before each call) on host tensors and the host seams: the
    route's own logic, which the lent GPU cannot run (it has no TensorFlow)."""
    from hvd_notebook.runtime.tensorflow.bridges import to_numpy
    from hvd_notebook.runtime.tensorflow.nccl import TensorFlowOnNccl

    on = TensorFlowOnNccl(host_backend, to_array=to_numpy, to_tensor=tf.convert_to_tensor)
    host_backend.transport.calls.clear()
    r, n = host_backend.rank, host_backend.size
    values = contribution((2, 3), r, np.float32)
    tensors = [tf.constant(values, dtype) for dtype in (tf.bfloat16, tf.float32, tf.float16)]
    outs = on.allreduce(tensors, ops.Average, 1.0, 1.0, ["bf16", "f32", "f16"])
    for t, out in zip(tensors, outs):
        assert out.dtype == t.dtype
        np.testing.assert_allclose(out.numpy().astype(np.float64), expected(ops.Average, (2, 3), n), rtol=1e-2)
    # bfloat16 reduced as float32 beside the float32 tensor, but agreed as bfloat16: its own buffer
    assert [c[:2] for c in host_backend.transport.calls] == [("allreduce", "float32")] * 3
    (gathered,) = on.allgather([tf.fill([r + 1, 2], tf.constant(r + 0.5, tf.bfloat16))], ["bf16.rows"])
    assert gathered.dtype == tf.bfloat16
    np.testing.assert_array_equal(gathered.numpy().astype(np.float64),
                                  np.concatenate([np.full((k + 1, 2), k + 0.5) for k in range(n)]))
    root = n - 1
    sent = on.broadcast([tf.constant([r + 1.5], tf.bfloat16), tf.constant([r, r], tf.int32)], root, ["b", "i"])
    assert [s.dtype for s in sent] == [tf.bfloat16, tf.int32]
    assert sent[0].numpy().astype(float).tolist() == [root + 1.5] and sent[1].numpy().tolist() == [root, root]
    (scattered,) = on.reducescatter([tf.ones([2 * n, 2], tf.bfloat16) * (r + 1)], ops.Sum, ["bf16.rs"])
    assert scattered.dtype == tf.bfloat16 and scattered.shape == (2, 2)
    np.testing.assert_array_equal(scattered.numpy().astype(np.float64), np.full((2, 2), n * (n + 1) / 2))
    with pytest.raises(MismatchError):
        on.allreduce([tf.ones([2 + r])], ops.Sum, 1.0, 1.0, ["tf.shapes"])


# ------------------------------------------------------------------ hvd's API routes device arrays here
class Marked(np.ndarray):
    """A host array that stands for a cupy array (``mpi_ops.is_device_array`` patched to say so)."""


def test_hvds_api_routes_device_arrays_to_the_nccl_backend(hvd, host_backend, monkeypatch):
    """``hvd.allreduce`` and friends hand device arrays (cupy's, on a GPU) to the world's NCCL backend, here
    the host seams standing in for it; without one, each rank says what to do, before any communication."""
    from hvd_notebook.runtime.core import world
    from hvd_notebook.runtime.tensorflow import mpi_ops

    monkeypatch.setattr(mpi_ops, "is_device_array", lambda x: isinstance(x, Marked))
    monkeypatch.setattr(world.current(), "nccl", host_backend)
    host_backend.transport.calls.clear()
    r, n = hvd.rank(), hvd.size()
    x = np.full((2, 3), r + 1.0, np.float32).view(Marked)
    np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Sum), np.full((2, 3), n * (n + 1) / 2))
    outs = hvd.grouped_allreduce([x, x * 2], op=hvd.Average)
    np.testing.assert_allclose(outs[1], np.full((2, 3), (n + 1.0)))
    gathered = hvd.allgather(np.full((r + 1, 2), r, np.int64).view(Marked))
    np.testing.assert_array_equal(gathered, np.concatenate([np.full((k + 1, 2), k) for k in range(n)]))
    np.testing.assert_array_equal(hvd.broadcast(x, root_rank=n - 1), np.full((2, 3), float(n)))
    swapped = hvd.alltoall(np.repeat(np.arange(n, dtype=np.float32), 2).view(Marked) + 10 * r)
    np.testing.assert_array_equal(swapped, np.repeat(np.arange(n) * 10.0 + r, 2))
    scattered = hvd.reducescatter(np.ones((2 * n, 2), np.float32).view(Marked), op=hvd.Sum)
    np.testing.assert_array_equal(scattered, np.full((2, 2), float(n)))
    assert host_backend.transport.kinds() == {"allreduce": 2, "allgather": 1, "broadcast": 1, "alltoall": 1,
                                              "reduce_scatter": 1}, host_backend.transport.calls
    monkeypatch.setattr(world.current(), "nccl", None)
    with pytest.raises(ValueError, match="needs NCCL on every rank"):
        hvd.allreduce(x, op=hvd.Sum)
    with pytest.raises(ValueError, match="needs NCCL on every rank"):
        hvd.alltoall(x)
