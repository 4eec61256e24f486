"""Every collective x dtype x rank of tensor, on numpy, eager TensorFlow and
inside tf.function; fusion, gradients, mismatches, objects, join. Modelled on
the categories of Horovod's test/parallel/test_tensorflow.py."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64"]
DIMS = [0, 1, 2, 3]
MODES = ["numpy", "eager", "graph"]


def np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def make(hvd, dtype, dim, scale=1):
    """A deterministic tensor that differs per rank: values rank+1 .. small enough for float16."""
    shape = (3,) * dim
    base = (np.arange(int(np.prod(shape))) % 5).reshape(shape) + 1
    return (base * (hvd.rank() + 1) * scale).astype(np_dtype(dtype))


def run(tf, mode, fn, *arrays):
    """Call fn on numpy arrays, on eager tensors, or inside a tf.function; return numpy."""
    if mode == "numpy":
        out = fn(*arrays)
    elif mode == "eager":
        out = fn(*[tf.convert_to_tensor(a) for a in arrays])
    else:
        out = tf.function(fn)(*[tf.convert_to_tensor(a) for a in arrays])
    if isinstance(out, (list, tuple)):
        return [to_numpy(o) for o in out]
    return to_numpy(out)


def to_numpy(x):
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def expected_reduce(hvd, op, dtype, dim):
    contributions = [((np.arange(3**dim) % 5).reshape((3,) * dim) + 1) * (r + 1) for r in range(hvd.size())]
    stacked = np.stack(contributions).astype(np.float64)
    return {hvd.Sum: stacked.sum(0), hvd.Average: stacked.mean(0), hvd.Min: stacked.min(0),
            hvd.Max: stacked.max(0), hvd.Product: stacked.prod(0)}[op]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_every_op_dim(hvd, tf, mode, dtype):
    for op, dim in itertools.product([hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product], DIMS):
        x = make(hvd, dtype, dim)
        out = run(tf, mode, lambda t, op=op: hvd.allreduce(t, op=op), x)
        assert out.shape == x.shape
        assert out.dtype == x.dtype, (op, dim)  # an average of integers too, truncated (Horovod 0.28)
        expected = expected_reduce(hvd, op, dtype, dim)
        if np.dtype(np_dtype(dtype)).kind == "i":
            expected = np.trunc(expected)
        np.testing.assert_allclose(out.astype(np.float64), expected,
                                   rtol=1e-2 if dtype in ("float16", "bfloat16") else 1e-6)


def test_allreduce_scaling_factors(hvd, tf):
    x = np.ones(4, np.float32)
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    np.testing.assert_allclose(out, np.full(4, 0.5 * hvd.size() * 3.0))
    out = hvd.allreduce(tf.ones([4]), op=hvd.Average, postscale_factor=2.0)
    np.testing.assert_allclose(out.numpy(), np.full(4, 2.0))


def test_allreduce_deprecated_average_argument(hvd):
    np.testing.assert_allclose(hvd.allreduce(np.ones(2), average=False), np.full(2, hvd.size()))
    with pytest.raises(ValueError, match="either op= or"):
        hvd.allreduce(np.ones(2), average=True, op=hvd.Sum)


def test_adasum_is_not_supported(hvd):
    with pytest.raises(NotImplementedError, match="Adasum is not supported"):
        hvd.allreduce(np.ones(2), op=hvd.Adasum)


@pytest.mark.parametrize("mode", MODES)
def test_fp16_compression_restores_dtype(hvd, tf, mode):
    x = make(hvd, "float32", 2)
    out = run(tf, mode, lambda t: hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16), x)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, expected_reduce(hvd, hvd.Sum, "float32", 2), rtol=1e-3)
    ints = make(hvd, "int32", 1)
    out = run(tf, mode, lambda t: hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16), ints)
    assert out.dtype == np.int32  # integers are not compressed


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_fused_equals_unfused(hvd, tf, mode, monkeypatch):
    arrays = [make(hvd, d, dim) for d, dim in [("float32", 1), ("float64", 2), ("float32", 3), ("int32", 0)]]
    fused = run(tf, mode, lambda *ts: hvd.grouped_allreduce(list(ts), op=hvd.Sum), *arrays)
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
    unfused = run(tf, mode, lambda *ts: hvd.grouped_allreduce(list(ts), op=hvd.Sum), *arrays)
    singles = [run(tf, mode, lambda t: hvd.allreduce(t, op=hvd.Sum), a) for a in arrays]
    for f, u, s, a in zip(fused, unfused, singles, arrays):
        assert f.dtype == a.dtype and f.shape == a.shape
        np.testing.assert_array_equal(f, u)
        np.testing.assert_array_equal(f, s)


@pytest.mark.parametrize("op", ["Sum", "Average", "Max"])
def test_single_tensor_path_equals_grouped_path(hvd, tf, op):
    # one eager tensor takes MpiBackend.allreduce_one (scaling in place); two go through a fusion buffer
    op = getattr(hvd, op)
    for dtype, dim in [("float32", 1), ("float64", 3), ("int32", 2), ("int64", 0)]:
        x = tf.convert_to_tensor(make(hvd, dtype, dim))
        kwargs = dict(op=op, postscale_factor=3.0) if dtype.startswith("float") else dict(op=op)
        single = hvd.allreduce(x, **kwargs)
        grouped = hvd.grouped_allreduce([x, tf.zeros([7], x.dtype)], **kwargs)[0]
        assert single.dtype == grouped.dtype and single.shape == x.shape
        np.testing.assert_array_equal(single.numpy(), grouped.numpy())


def test_results_stay_valid_while_held(hvd, tf):
    # results live in pooled buffers: a buffer is reused only once nothing refers to it any more
    held, expected = [], []
    for i in range(6):
        x = tf.fill([1000], float(i))
        out = hvd.allreduce(x, op=hvd.Sum)
        kept = {0: out, 1: tf.identity(out), 2: tf.reshape(out, [10, 100]), 3: out.numpy(),
                4: hvd.allreduce(np.full(1000, float(i)), op=hvd.Sum), 5: out[:10]}[i]
        held.append(kept)
        expected.append(np.full(np.shape(kept), i * hvd.size(), np.float64))
        del out
    for _ in range(3):  # more calls of the same size, which would reuse any buffer wrongly thought free
        hvd.allreduce(tf.fill([1000], -1.0), op=hvd.Sum)
        hvd.allreduce(np.full(1000, -1.0), op=hvd.Sum)
    for kept, want in zip(held, expected):
        np.testing.assert_array_equal(np.asarray(kept, np.float64), want)


def test_autograph_leaves_the_runtime_alone(hvd, tf, monkeypatch):
    # inside a user's tf.function, AutoGraph must not rewrite the runtime: its rewritten
    # numpy_function callbacks would pay AutoGraph's dispatch on every call of every step
    import inspect

    from hvd_notebook.runtime.core import world
    rt = world.current().mpi
    frames: list[str] = []
    for method in ("allreduce_one", "allreduce_fused", "allgather"):
        original = getattr(rt, method)

        def spy(*args, original=original, **kwargs):
            frames.extend(f.filename for f in inspect.stack())
            return original(*args, **kwargs)

        monkeypatch.setattr(rt, method, spy)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(x * x)
        grad = hvd.DistributedGradientTape(tape).gradient(y, x)
        return hvd.allreduce(y, op=hvd.Sum), hvd.grouped_allreduce([x, grad]), hvd.allgather(x)

    total, (mean_x, mean_grad), gathered = step(tf.ones([3]))
    assert float(total) == 3.0 * hvd.size() and gathered.shape == [3 * hvd.size()]
    np.testing.assert_allclose(mean_grad.numpy(), np.full(3, 2.0))
    assert frames, "the runtime was not called"
    rewritten = sorted({f for f in frames if "__autograph_generated" in f})
    assert not rewritten, f"AutoGraph rewrote the runtime: {rewritten}"


def test_fusion_packs_one_buffer_per_dtype(hvd, monkeypatch):
    from hvd_notebook.runtime.core.mpi_backend import MpiAllreduce

    arrays = [np.ones(256, np.float32), np.ones(3, np.float64), np.ones(256, np.float32), np.ones(256, np.float32)]
    assert MpiAllreduce.fusion_plan(arrays) == [[0, 2, 3], [1]]
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", str(2 * 1024))  # two 1 KiB tensors per buffer
    assert MpiAllreduce.fusion_plan(arrays) == [[0, 2], [1], [3]]
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
    assert MpiAllreduce.fusion_plan(arrays) == [[0], [1], [2], [3]]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_with_different_first_dimensions(hvd, tf, mode, dtype):
    for dim in [1, 2, 3]:
        rows = hvd.rank() + 1
        x = (np.ones((rows,) + (2,) * (dim - 1)) * hvd.rank()).astype(np_dtype(dtype))
        out = run(tf, mode, hvd.allgather, x)
        total = sum(r + 1 for r in range(hvd.size()))
        assert out.shape == (total,) + (2,) * (dim - 1) and out.dtype == x.dtype
        expected = np.concatenate([np.full((r + 1,) + (2,) * (dim - 1), r) for r in range(hvd.size())])
        np.testing.assert_array_equal(out.astype(np.float64), expected)


def test_grouped_allgather(hvd):
    outs = hvd.grouped_allgather([np.full((1, 2), hvd.rank()), np.full((hvd.rank() + 1,), 7, np.int64)])
    np.testing.assert_array_equal(outs[0], np.array([[r, r] for r in range(hvd.size())]))
    assert outs[1].shape == (sum(r + 1 for r in range(hvd.size())),)


def test_allgather_of_a_scalar_is_an_error(hvd):
    with pytest.raises(ValueError, match="at least one dimension"):
        hvd.allgather(np.float32(1.0))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_from_each_root(hvd, tf, mode, dtype):
    for root, dim in itertools.product(range(hvd.size()), DIMS):
        x = make(hvd, dtype, dim)
        out = run(tf, mode, lambda t, root=root: hvd.broadcast(t, root_rank=root), x)
        assert out.dtype == x.dtype
        np.testing.assert_array_equal(out, (make(hvd, dtype, dim) / (hvd.rank() + 1) * (root + 1)).astype(x.dtype))


def test_broadcast_variables(hvd, tf):
    v1 = tf.Variable(np.full((2, 2), hvd.rank(), np.float32))
    v2 = tf.Variable(np.full(3, hvd.rank() + 10, np.int64))
    hvd.broadcast_variables([v1, v2], root_rank=1)
    np.testing.assert_array_equal(v1.numpy(), np.ones((2, 2)))
    np.testing.assert_array_equal(v2.numpy(), np.full(3, 11))
    v3 = tf.Variable(np.full(2, hvd.rank(), np.float64))

    @tf.function
    def bcast():
        hvd.broadcast_variables([v3], root_rank=0)

    bcast()
    np.testing.assert_array_equal(v3.numpy(), np.zeros(2))


def test_broadcast_and_allgather_objects(hvd):
    obj = {"rank": hvd.rank(), "nested": [(1, 2.5), {"deep": {hvd.rank(): "x" * (hvd.rank() + 1)}}], "none": None}
    got = hvd.broadcast_object(obj, root_rank=1)
    assert got == {"rank": 1, "nested": [(1, 2.5), {"deep": {1: "xx"}}], "none": None}
    everyone = hvd.allgather_object(obj)
    assert [o["rank"] for o in everyone] == list(range(hvd.size()))
    assert everyone[0]["nested"][1]["deep"] == {0: "x"}


@pytest.mark.parametrize("mode", MODES)
def test_alltoall(hvd, tf, mode):
    n, r = hvd.size(), hvd.rank()
    x = (np.arange(2 * n) + 100 * r).astype(np.float32)
    out = run(tf, mode, hvd.alltoall, x)
    np.testing.assert_array_equal(out, np.concatenate([np.arange(2 * r, 2 * r + 2) + 100 * s for s in range(n)]))
    splits = np.array([1 + (r + s) % 2 for s in range(n)], np.int32)  # uneven
    x = np.arange(splits.sum() * 2, dtype=np.int64).reshape(-1, 2) + 1000 * r
    out, received = run(tf, mode, lambda t, s: hvd.alltoall(t, splits=s), x, splits)
    assert received.tolist() == [1 + (s + r) % 2 for s in range(n)]
    assert out.shape == (received.sum(), 2)


def test_alltoall_bad_splits(hvd):
    with pytest.raises(ValueError, match="one non-negative entry per rank"):
        hvd.alltoall(np.arange(4), splits=[4])


@pytest.mark.parametrize("mode", MODES)
def test_reducescatter(hvd, tf, mode):
    n, r = hvd.size(), hvd.rank()
    rows = 2 * n + 1  # uneven: the first rank gets one more row
    x = (np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)) * (r + 1)
    out = run(tf, mode, lambda t: hvd.reducescatter(t, op=hvd.Sum), x)
    total = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) * sum(range(1, n + 1))
    counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    start = sum(counts[:r])
    np.testing.assert_allclose(out, total[start:start + counts[r]])
    avg = run(tf, mode, lambda t: hvd.reducescatter(t, op=hvd.Average), x)
    np.testing.assert_allclose(avg, total[start:start + counts[r]] / n)
    outs = hvd.grouped_reducescatter([x, x[:, :1]], op=hvd.Sum)
    np.testing.assert_allclose(outs[1], total[start:start + counts[r], :1])


def test_indexed_slices_allreduce(hvd, tf):
    values = tf.ones([2, 3]) * (hvd.rank() + 1)
    indices = tf.constant([hvd.rank(), 5])
    out = hvd.allreduce(tf.IndexedSlices(values, indices, dense_shape=tf.constant([8, 3])), op=hvd.Average)
    assert isinstance(out, tf.IndexedSlices)
    assert out.values.shape == (2 * hvd.size(), 3)
    assert sorted(out.indices.numpy().tolist()) == sorted(list(range(hvd.size())) + [5] * hvd.size())
    np.testing.assert_allclose(out.values.numpy()[:2], np.full((2, 3), 1.0 / hvd.size()))


@pytest.mark.parametrize("graph", [False, True])
def test_gradients(hvd, tf, graph):
    n, r = hvd.size(), hvd.rank()
    x = tf.Variable(np.arange(1.0, 4.0, dtype=np.float32))

    def grads():
        with tf.GradientTape(persistent=True) as tape:
            summed = hvd.allreduce(x * (r + 1), op=hvd.Sum)
            averaged = hvd.allreduce(x, op=hvd.Average)
            gathered = hvd.allgather(x * (r + 1))
            broadcast = hvd.broadcast(x, root_rank=0)
            weights = tf.cast(tf.range(tf.shape(gathered)[0]) + 1, tf.float32)
            losses = [tf.reduce_sum(summed), tf.reduce_sum(averaged), tf.reduce_sum(gathered * weights),
                      tf.reduce_sum(broadcast)]
        return [tape.gradient(loss, x) for loss in losses]

    g_sum, g_avg, g_gather, g_bcast = [g.numpy() for g in (tf.function(grads)() if graph else grads())]
    np.testing.assert_allclose(g_sum, np.full(3, n * (r + 1)))  # allreduce(Sum) of ones, times r+1
    np.testing.assert_allclose(g_avg, np.ones(3))  # average of ones
    # allgather: the averaged upstream gradient's rows for this rank, times r+1 (Horovod 0.28 averages)
    rows = np.arange(3 * n, dtype=np.float32) + 1
    np.testing.assert_allclose(g_gather, rows[3 * r:3 * r + 3] * (r + 1))
    np.testing.assert_allclose(g_bcast, np.ones(3) if r == 0 else np.zeros(3))  # the average, at the root only


def test_mismatched_shapes_raise_on_every_rank_naming_ranks(hvd, tf):
    t0 = time.monotonic()
    with pytest.raises(hvd.MismatchError) as info:
        hvd.allreduce(np.ones(3 + hvd.rank(), np.float32), name="grad/w")
    assert time.monotonic() - t0 < 10
    message = str(info.value)
    assert "allreduce of tensor 'grad/w' does not match across ranks" in message
    assert "rank(s) [0]" in message and "rank(s) [1]" in message and "(3,)" in message and "(4,)" in message
    with pytest.raises(tf.errors.FailedPreconditionError, match="does not match across ranks"):
        hvd.allreduce(tf.ones([2 + hvd.rank()]))
    hvd.barrier()  # still usable


def test_mismatched_dtypes_roots_and_collectives(hvd):
    with pytest.raises(hvd.MismatchError, match=r"dtype: rank\(s\) \[0\] 'float32', rank\(s\) \[1\] 'float64'"):
        hvd.allreduce(np.ones(2, np.float32 if hvd.rank() == 0 else np.float64))
    with pytest.raises(hvd.MismatchError, match=r"root_rank: rank\(s\) \[0\] 0, rank\(s\) \[1\] 1"):
        hvd.broadcast(np.ones(2), root_rank=hvd.rank())
    with pytest.raises(hvd.MismatchError, match="Ranks called different collectives"):
        if hvd.rank() == 0:
            hvd.allreduce(np.ones(2))
        else:
            hvd.allgather(np.ones(2))
    with pytest.raises(hvd.MismatchError, match="op: rank"):
        hvd.allreduce(np.ones(2), op=hvd.Sum if hvd.rank() == 0 else hvd.Max)
    assert hvd.allreduce(np.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2  # still usable


def test_bad_root_rank(hvd):
    with pytest.raises(ValueError, match="is not a rank"):
        hvd.broadcast(np.ones(2), root_rank=hvd.size())


def test_join_fills_in_zeros(hvd):
    if hvd.rank() == 0:
        last = hvd.join()
    else:
        out = hvd.allreduce(np.full(3, 4.0), op=hvd.Sum)
        np.testing.assert_allclose(out, np.full(3, 4.0))  # rank 0 contributed zeros
        last = hvd.join()
    assert last == hvd.size() - 1


def test_join_serves_eager_tensors(hvd, tf):
    # the single eager tensor path (MpiBackend.allreduce_one) meets a joined rank too
    if hvd.rank() == 0:
        last = hvd.join()
    else:
        summed = hvd.allreduce(tf.fill([2, 3], 4.0), op=hvd.Sum)
        averaged = hvd.allreduce(tf.fill([5], 4.0), op=hvd.Average)
        np.testing.assert_allclose(summed.numpy(), np.full([2, 3], 4.0))
        np.testing.assert_allclose(averaged.numpy(), np.full([5], 4.0 / hvd.size()))
        last = hvd.join()
    assert last == hvd.size() - 1


def test_agreement_road(hvd):
    # both ranks share this host: shared memory, unless HVD_NOTEBOOK_SHM_AGREEMENT=0 asks for the collective
    import os

    from hvd_notebook.runtime.core import world
    board = world.current().negotiator.board
    assert (board is not None) == (os.environ.get("HVD_NOTEBOOK_SHM_AGREEMENT", "1") != "0")


def test_process_queries(hvd):
    assert hvd.is_initialized() and hvd.mpi_enabled() and not hvd.nccl_built()
    assert hvd.size() == 2 and hvd.local_size() == 2 and hvd.cross_size() == 1
    assert hvd.rank() == hvd.local_rank() and hvd.is_homogeneous()
    assert isinstance(hvd.mpi_threads_supported(), bool)
