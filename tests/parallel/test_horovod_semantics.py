"""Horovod's semantics where its own test suite checks them, on 2 ranks: the error types of a
mismatch in a TF1 graph, the gradients of allgather, broadcast, alltoall and reducescatter (eagerly,
in a tf.function and in a TF1 graph), and the object collectives with a TF1 session."""

from __future__ import annotations

import numpy as np
import pytest

MODES = ["eager", "function", "tf1"]


def _gradient(tf, mode, forward, x0, upstream):
    """d(sum(forward(x) * upstream(y)))/dx at x0, computed eagerly, in a tf.function or in a TF1 graph."""
    def eager():
        x = tf.Variable(x0)
        with tf.GradientTape() as tape:
            y = forward(x)
            loss = tf.reduce_sum(y * upstream(y))
        return tape.gradient(loss, x).numpy()

    if mode == "eager":
        return eager()
    if mode == "function":
        return _in_function(tf, forward, x0, upstream)
    with tf.Graph().as_default():
        x = tf.constant(x0)
        y = forward(x)
        (g,) = tf.gradients(tf.reduce_sum(y * upstream(y)), [x])
        with tf.compat.v1.Session() as sess:
            return sess.run(g)


def _in_function(tf, forward, x0, upstream):
    x = tf.Variable(x0)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            y = forward(x)
            loss = tf.reduce_sum(y * upstream(y))
        return tape.gradient(loss, x)

    return step().numpy()


@pytest.mark.parametrize("mode", MODES)
def test_allgather_gradient_is_the_average_of_this_ranks_rows(hvd, tf, mode):
    n, r = hvd.size(), hvd.rank()
    x0 = np.ones((r + 1, 2), np.float32)  # a different number of rows on each rank
    # the upstream gradient differs by rank: rank k weighs every gathered row by k + 1
    grad = _gradient(tf, mode, lambda x: hvd.allgather(x), x0, lambda y: tf.ones_like(y) * float(r + 1))
    mean_weight = sum(k + 1 for k in range(n)) / n
    np.testing.assert_allclose(grad, np.full((r + 1, 2), mean_weight))


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_gradient_is_the_average_at_the_root_only(hvd, tf, mode):
    n, r = hvd.size(), hvd.rank()
    grad = _gradient(tf, mode, lambda x: hvd.broadcast(x, root_rank=1), np.ones(3, np.float32),
                     lambda y: tf.ones_like(y) * float(r + 1))
    expected = np.full(3, sum(k + 1 for k in range(n)) / n) if r == 1 else np.zeros(3)
    np.testing.assert_allclose(grad, expected)


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_gradient_sends_the_rows_back(hvd, tf, mode):
    n, r = hvd.size(), hvd.rank()
    # rank r sends r + 1 rows to every rank; row values say which rank sent them
    x0 = np.full((n * (r + 1), 2), float(r), np.float32)
    splits = [r + 1] * n

    def upstream(y):  # the receiver weighs each row by 10 * (receiver + 1) plus the sender
        return tf.ones_like(y) * 10.0 * (r + 1) + y

    grad = _gradient(tf, mode, lambda x: hvd.alltoall(x, splits=splits)[0], x0, upstream)
    expected = np.concatenate([np.full((r + 1, 2), 10.0 * (k + 1) + 2 * r) for k in range(n)])
    np.testing.assert_allclose(grad, expected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op_name", ["Sum", "Average"])
def test_reducescatter_gradient_gathers_the_blocks(hvd, tf, mode, op_name):
    n, r = hvd.size(), hvd.rank()
    op = getattr(hvd, op_name)
    x0 = np.arange(n * 2 * 3, dtype=np.float32).reshape(n * 2, 3)
    grad = _gradient(tf, mode, lambda x: hvd.reducescatter(x, op=op, prescale_factor=0.5), x0,
                     lambda y: tf.ones_like(y) * float(r + 1))
    # as Horovod: every rank's block of upstream gradient, gathered, times the size for a Sum, times the scales
    scale = (n if op_name == "Sum" else 1) * 0.5
    expected = np.concatenate([np.full((2, 3), float(k + 1)) for k in range(n)]) * scale
    np.testing.assert_allclose(grad, expected)


@pytest.mark.parametrize("collective", ["allreduce", "allgather", "broadcast", "reducescatter", "alltoall"])
def test_a_mismatch_in_a_tf1_graph_is_failed_precondition_on_every_rank(hvd, tf, collective):
    r = hvd.rank()
    with tf.Graph().as_default():
        tensor = tf.ones([2, 3 + r], tf.float32)  # the second dimension differs by rank
        build = {
            "allreduce": lambda: hvd.allreduce(tensor, name="mismatched"),
            "allgather": lambda: hvd.allgather(tensor, name="mismatched"),
            "broadcast": lambda: hvd.broadcast(tensor, root_rank=0, name="mismatched"),
            "reducescatter": lambda: hvd.reducescatter(tensor, name="mismatched"),
            "alltoall": lambda: hvd.alltoall(tensor, name="mismatched"),
        }[collective]
        out = build()
        fine = hvd.allreduce(tf.ones([4]), op=hvd.Sum, name="fine")
        with tf.compat.v1.Session() as sess:
            with pytest.raises(tf.errors.FailedPreconditionError, match="does not match across ranks"):
                sess.run(out)
            np.testing.assert_allclose(sess.run(fine), np.full(4, float(hvd.size())))  # still usable


def test_a_tf1_graph_collective_that_matches_runs_through_the_gate(hvd, tf):
    with tf.Graph().as_default():
        gathered = hvd.allgather(tf.fill([1, 2], float(hvd.rank())))
        summed = hvd.allreduce(tf.ones([3], tf.int32), op=hvd.Sum)
        with tf.compat.v1.Session() as sess:
            g, s = sess.run([gathered, summed])
    np.testing.assert_allclose(g, np.repeat(np.arange(hvd.size(), dtype=np.float32)[:, None], 2, axis=1))
    np.testing.assert_array_equal(s, np.full(3, hvd.size()))


def test_object_collectives_take_a_tf1_session(hvd, tf):
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        assert hvd.broadcast_object({"rank": hvd.rank()}, root_rank=1, session=sess) == {"rank": 1}
        assert hvd.allgather_object(hvd.rank() * 10, session=sess) == [k * 10 for k in range(hvd.size())]
    with pytest.raises(ValueError, match="session="):
        hvd.broadcast_object(1, session="not a session")


@pytest.mark.parametrize("graph", [False, True])
def test_a_bad_argument_is_invalid_argument_and_still_a_value_error(hvd, tf, graph):
    tensor = tf.ones([hvd.size() + 1])  # rows that do not divide evenly among the ranks
    if not graph:
        with pytest.raises(tf.errors.InvalidArgumentError, match="divide evenly") as info:
            hvd.alltoall(tensor)
        assert isinstance(info.value, ValueError)
        return
    with tf.Graph().as_default():
        out = hvd.alltoall(tf.ones([hvd.size() + 1]))
        with tf.compat.v1.Session() as sess, pytest.raises(tf.errors.InvalidArgumentError, match="divide evenly"):
            sess.run(out)


@pytest.mark.parametrize("scale", ["prescale_factor", "postscale_factor"])
def test_indexed_slices_refuse_scale_factors(hvd, tf, scale):
    slices = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([hvd.rank()]), dense_shape=tf.constant([4, 3]))
    with pytest.raises(NotImplementedError, match=scale):
        hvd.allreduce(slices, op=hvd.Sum, **{scale: 0.5})
    assert isinstance(hvd.allreduce(slices, op=hvd.Sum, **{scale: 1.0}), tf.IndexedSlices)


@pytest.mark.parametrize("graph", [False, True])
def test_grouped_allreduce_gathers_indexed_slices_and_reduces_the_dense(hvd, tf, graph):
    n, r = hvd.size(), hvd.rank()

    def build():
        slices = tf.IndexedSlices(tf.fill([1, 2], float(r + 1)), tf.constant([r]), dense_shape=tf.constant([4, 2]))
        dense = tf.fill([3], float(r + 1))
        return hvd.grouped_allreduce([slices, dense], op=hvd.Average)

    if graph:
        with tf.Graph().as_default():
            out_slices, out_dense = build()
            with tf.compat.v1.Session() as sess:
                values, indices, dense = sess.run([out_slices.values, out_slices.indices, out_dense])
    else:
        out_slices, out_dense = build()
        values, indices, dense = out_slices.values.numpy(), out_slices.indices.numpy(), out_dense.numpy()
    mean = sum(k + 1 for k in range(n)) / n
    np.testing.assert_allclose(values, np.array([[(k + 1) / n] * 2 for k in range(n)]))
    np.testing.assert_array_equal(indices, np.arange(n))
    np.testing.assert_allclose(dense, np.full(3, mean))


@pytest.mark.parametrize("op_name", ["Min", "Max", "Product", "Adasum"])
def test_grouped_allreduce_with_indexed_slices_refuses_other_ops(hvd, tf, op_name):
    slices = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([hvd.rank()]), dense_shape=tf.constant([4, 3]))
    with pytest.raises(NotImplementedError, match="Average or hvd.Sum"):
        hvd.grouped_allreduce([tf.ones([2]), slices], op=getattr(hvd, op_name))


@pytest.mark.parametrize("dtype", ["float16", "int32"])
@pytest.mark.parametrize("where", ["prescale_factor", "postscale_factor"])
def test_reducescatter_scales_float16_in_float32_and_integers_in_float64(hvd, tf, dtype, where):
    n, r = hvd.size(), hvd.rank()
    factor = 0.3719  # not exact in float16: rounding it first would change the result
    x = np.linspace(-50, 50, n * 4 * 3).reshape(n * 4, 3).astype(dtype)
    out = hvd.reducescatter(tf.constant(x), op=hvd.Sum, **{where: factor}).numpy()
    block = x[r * 4:(r + 1) * 4]
    wide = np.float32 if dtype == "float16" else np.float64
    if where == "postscale_factor":  # the sum, then scaled in the wider type, then back
        expected = ((block * n).astype(wide) * wide(factor)).astype(dtype)
    else:  # each rank's tensor scaled (and back to its dtype) before the sum
        expected = ((block.astype(wide) * wide(factor)).astype(dtype) * n).astype(dtype)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, expected)
