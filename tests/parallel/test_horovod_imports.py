"""Horovod's import lines on 2 real ranks: ``horovod.tensorflow`` and its Keras flavours are the runtime
(where no real Horovod is installed), and the names Horovod code meets work: the ``*_op`` queries,
in-place ``broadcast_``, the Keras module's value-level collectives."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def horovod(hvd):
    import horovod.tensorflow

    if not hasattr(__import__("horovod"), "__hvd_notebook_alias__"):
        pytest.skip("a real horovod is installed here: the alias steps aside")
    return horovod.tensorflow


def test_the_import_lines_give_the_runtime(hvd, horovod):
    import horovod.keras as hvd_keras
    import horovod.tensorflow.keras as hvdk
    import horovod.tensorflow.keras.callbacks as callbacks

    import hvd_notebook.runtime.keras as runtime_keras
    import hvd_notebook.runtime.keras.callbacks as runtime_callbacks

    assert horovod.allreduce is hvd.allreduce and horovod.rank is hvd.rank
    assert hvdk.allreduce is runtime_keras.allreduce and hvd_keras.broadcast is runtime_keras.broadcast
    assert hvdk.DistributedOptimizer is hvd.DistributedOptimizer and hvdk.size is hvd.size
    assert callbacks.BroadcastGlobalVariablesCallback is runtime_callbacks.BroadcastGlobalVariablesCallback
    assert hvdk.callbacks.MetricAverageCallback is runtime_callbacks.MetricAverageCallback
    assert horovod.rank() == hvd.rank() and horovod.size() == 2
    np.testing.assert_allclose(horovod.allreduce(np.array([1.0, 2.0]) * (horovod.rank() + 1), op=horovod.Sum),
                               [3.0, 6.0])


def test_query_ops(hvd, horovod, tf):
    assert int(horovod.size_op()) == hvd.size() and int(horovod.rank_op()) == hvd.rank()
    assert int(horovod.local_size_op()) == hvd.local_size() and int(horovod.local_rank_op()) == hvd.local_rank()
    assert horovod.rank_op().dtype == tf.int32
    assert int(horovod.process_set_included_op()) == 1 and int(horovod.process_set_included_op(5)) == -3
    with pytest.raises(ValueError, match="Process set 1 does not exist or has not been registered"):
        horovod.size_op(process_set_id=1)

    @tf.function
    def traced():
        return horovod.rank_op() * 10 + horovod.size_op()

    assert int(traced()) == hvd.rank() * 10 + hvd.size()
    with tf.Graph().as_default():  # a TF1 graph: the value is read when the op runs
        ops = [horovod.rank_op(), horovod.size_op(), horovod.local_rank_op(), horovod.local_size_op()]
        with tf.compat.v1.Session() as session:
            assert session.run(ops) == [hvd.rank(), 2, hvd.local_rank(), hvd.local_size()]


def test_built_flags(horovod):
    assert not horovod.ccl_built() and not horovod.ddl_built() and not horovod.rocm_built()
    assert horovod.cuda_built() == horovod.nccl_built()
    assert horovod._executing_eagerly()
    from horovod.tensorflow.util import _executing_eagerly

    assert _executing_eagerly()


def test_broadcast_in_place(hvd, horovod, tf):
    for root in (0, 1):
        variables = [tf.Variable(tf.ones([3]) * hvd.rank()), tf.Variable(tf.fill([2, 2], hvd.rank() + 10))]
        values = horovod.broadcast_(variables, root_rank=root)
        np.testing.assert_array_equal(variables[0].numpy(), [root] * 3)
        np.testing.assert_array_equal(variables[1].numpy(), np.full([2, 2], root + 10))
        np.testing.assert_array_equal(values[1].numpy(), variables[1].numpy())
    with tf.Graph().as_default():
        resource = tf.compat.v1.Variable(tf.ones([2]) * hvd.rank(), use_resource=True)
        ref = tf.compat.v1.Variable(tf.ones([2]) * hvd.rank() + 5, use_resource=False)
        values = horovod.broadcast_([resource, ref], 1, name="in_place")
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            first, second = session.run(values)
            np.testing.assert_array_equal(first, [1, 1])
            np.testing.assert_array_equal(second, [6, 6])
            np.testing.assert_array_equal(session.run(ref), [6, 6])


def test_keras_module_value_collectives(hvd, horovod):
    import horovod.keras as hvd_keras
    import horovod.tensorflow.keras as hvdk

    r = hvd.rank()
    np.testing.assert_allclose(hvdk.allreduce([1.0 * r, 2.0]), [0.5, 2.0])  # average
    np.testing.assert_allclose(hvd_keras.allreduce(np.float32(r + 1), op=hvdk.Sum), 3.0)
    np.testing.assert_array_equal(hvdk.allgather([[r, r]]), [[0, 0], [1, 1]])
    np.testing.assert_array_equal(hvdk.broadcast(np.arange(3) + r, root_rank=1), [1, 2, 3])
    np.testing.assert_allclose(hvdk.reducescatter(np.ones([2, 2]) * r, op=hvdk.Sum), [[1.0, 1.0]])
    with pytest.raises(RuntimeError, match="does not support eager execution"):
        hvdk.broadcast_global_variables(0)
