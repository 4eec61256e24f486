"""The TF1 graph pieces without MPI: the step's gradients become one op, refused
arguments are refused before any world is needed."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from hvd_notebook.runtime.keras.training import DistributedOptimizer  # noqa: E402
from hvd_notebook.runtime.tensorflow import tf1  # noqa: E402

SETTINGS = dict(op=0, compression=None, sparse_as_dense=False, predivide=1.0)


def _doubling(grads, **settings):
    """Stands in for the reduction over ranks: dense gradients doubled, sparse values doubled."""
    return [None if g is None else tf.IndexedSlices(g.values * 2, g.indices, g.dense_shape)
            if isinstance(g, tf.IndexedSlices) else g * 2 for g in grads]


def _py_function_ops(graph):
    return [op for op in graph.get_operations() if op.type == "EagerPyFunc"]


def test_a_steps_gradients_become_one_op(monkeypatch):
    calls = []
    monkeypatch.setattr(tf1, "reduce_gradients", lambda grads, **s: calls.append(len(grads)) or _doubling(grads))
    with tf.Graph().as_default() as graph:
        dense32 = tf.constant([[1.0, 2.0]])
        dense64 = tf.constant([3.0], tf.float64)
        sparse = tf.IndexedSlices(tf.constant([[5.0, 6.0]]), tf.constant([1]), tf.constant([3, 2]))
        out = tf1.reduce_in_one_op([dense32, None, sparse, dense64], SETTINGS)
        assert len(_py_function_ops(graph)) == 1
        assert out[1] is None and isinstance(out[2], tf.IndexedSlices)
        assert out[0].shape == (1, 2) and out[3].dtype == tf.float64
        assert out[2].values.shape.as_list() == [None, 2]
        with tf.compat.v1.Session() as sess:
            a, c, d = sess.run([out[0], tf.convert_to_tensor(out[2]), out[3]])
    assert calls == [3]  # the None gradient is not sent
    np.testing.assert_array_equal(a, [[2.0, 4.0]])
    np.testing.assert_array_equal(c, [[0, 0], [10.0, 12.0], [0, 0]])
    np.testing.assert_array_equal(d, [6.0])


def test_sparse_as_dense_sends_dense_gradients(monkeypatch):
    seen = []
    monkeypatch.setattr(tf1, "reduce_gradients", lambda grads, **s: seen.extend(grads) or _doubling(grads))
    with tf.Graph().as_default():
        sparse = tf.IndexedSlices(tf.constant([[5.0]]), tf.constant([0]), tf.constant([2, 1]))
        (out,) = tf1.reduce_in_one_op([sparse], dict(SETTINGS, sparse_as_dense=True))
        assert not isinstance(out, tf.IndexedSlices)
        with tf.compat.v1.Session() as sess:
            np.testing.assert_array_equal(sess.run(out), [[10.0], [0.0]])
    assert not any(isinstance(g, tf.IndexedSlices) for g in seen)


def test_eagerly_the_reduction_runs_directly(monkeypatch):
    monkeypatch.setattr(tf1, "reduce_gradients", lambda grads, **s: _doubling(grads))
    (out,) = tf1.reduce_in_one_op([tf.constant([1.0])], SETTINGS)
    np.testing.assert_array_equal(out.numpy(), [2.0])


def test_tf1_and_keras_optimizers_are_told_apart():
    import keras

    assert tf1.is_v1_optimizer(tf.compat.v1.train.AdagradOptimizer(0.01))
    assert not tf1.is_v1_optimizer(keras.optimizers.SGD(0.1))


@pytest.mark.parametrize("argument", ["device_dense", "device_sparse", "num_groups", "groups"])
def test_tf1_optimizer_refuses_unsupported_arguments(argument):
    value = {"num_groups": 2, "groups": [[0]]}.get(argument, "x")
    with pytest.raises(ValueError, match=f"DistributedOptimizer\\({argument}=.* is not supported"):
        DistributedOptimizer(tf.compat.v1.train.AdagradOptimizer(0.01), **{argument: value})


def test_other_optimizers_and_eager_accumulation_are_refused():
    with pytest.raises(TypeError, match=r"Keras 2's from tf_keras\) or a tf.compat.v1.train.Optimizer, not str"):
        DistributedOptimizer("sgd")
    with pytest.raises(ValueError, match="backward_passes_per_step=2 needs a graph"):
        DistributedOptimizer(tf.compat.v1.train.AdagradOptimizer(0.01), backward_passes_per_step=2)
    with pytest.raises(NotImplementedError, match="Adasum is not supported"):
        DistributedOptimizer(tf.compat.v1.train.AdagradOptimizer(0.01), op=2)


def test_broadcast_global_variables_needs_a_graph_and_a_process_set_if_any():
    with pytest.raises(RuntimeError, match="use hvd.broadcast_variables"):
        tf1.broadcast_global_variables(0)
    with pytest.raises(ValueError, match=r"process_set='ps'\): process_set takes a hvd.ProcessSet"):
        tf1.BroadcastGlobalVariablesHook(0, process_set="ps")


def test_apply_before_compute_with_accumulation_says_what_to_do():
    with tf.Graph().as_default():
        opt = DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), backward_passes_per_step=2)
        v = tf.compat.v1.get_variable("v", initializer=np.zeros(2, np.float32))
        with pytest.raises(ValueError, match="call the DistributedOptimizer's compute_gradients"):
            opt.apply_gradients([(tf.ones(2), v)])
