"""Horovod's TF1 graph API on 2 ranks: DistributedOptimizer around a tf.compat.v1
optimizer, BroadcastGlobalVariablesHook and broadcast_global_variables, in
tf.compat.v1 graphs, sessions and MonitoredTrainingSession."""

from __future__ import annotations

import numpy as np
import pytest


def _model(tf, hvd, seed_offset: int = 0):
    """A small MLP on synthetic data, with weights drawn from a different seed on each rank."""
    rng = np.random.default_rng(100 + hvd.rank() + seed_offset)
    x = tf.constant(rng.normal(size=(16, 4)).astype(np.float32))
    y = tf.constant(rng.normal(size=(16, 1)).astype(np.float32))
    w1 = tf.compat.v1.get_variable("w1", initializer=rng.normal(size=(4, 8)).astype(np.float32))
    b1 = tf.compat.v1.get_variable("b1", initializer=np.zeros(8, np.float32))
    w2 = tf.compat.v1.get_variable("w2", initializer=rng.normal(size=(8, 1)).astype(np.float32))
    loss = tf.reduce_mean(tf.square(tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) - y))
    return loss, [w1, b1, w2]


def _gathered(hvd, arrays):
    return [hvd.allgather(np.asarray(a)[None]) for a in arrays]


def _assert_same_on_ranks(hvd, arrays):
    for both in _gathered(hvd, arrays):
        np.testing.assert_allclose(both[0], both[1], rtol=1e-6)


def test_the_original_example_under_monitored_training_session(hvd, tf, tmp_path):
    with tf.Graph().as_default():
        config = tf.compat.v1.ConfigProto()
        loss, weights = _model(tf, hvd)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.AdagradOptimizer(0.01))
        final = {}

        class KeepFinalWeights(tf.compat.v1.train.SessionRunHook):
            def end(self, session):
                final["weights"] = session.run(weights)

        hooks = [hvd.BroadcastGlobalVariablesHook(0), tf.compat.v1.train.StopAtStepHook(last_step=20),
                 KeepFinalWeights()]
        train_op = opt.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
        checkpoint_dir = str(tmp_path / "ckpt") if hvd.rank() == 0 else None
        own_start = None
        steps = 0
        with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir, config=config,
                                                         hooks=hooks) as sess:
            start = sess.run(weights)
            while not sess.should_stop():
                sess.run(train_op)
                steps += 1
        end = final["weights"]
        with tf.compat.v1.Session() as plain:
            plain.run(tf.compat.v1.global_variables_initializer())
            own_start = plain.run(weights)
    assert steps == 20
    # rank 1 started from rank 0's values, not its own
    _assert_same_on_ranks(hvd, start)
    if hvd.rank() == 1:
        assert not np.allclose(own_start[0], start[0])
    assert not np.allclose(start[0], end[0])  # it trained
    _assert_same_on_ranks(hvd, end)


def test_compute_and_apply_gradients_separately(hvd, tf):
    with tf.Graph().as_default():
        loss, weights = _model(tf, hvd)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
        local = tf.compat.v1.train.GradientDescentOptimizer(0.1).compute_gradients(loss, weights)
        pairs = opt.compute_gradients(loss, weights)
        train_op = opt.apply_gradients(pairs)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            mine = sess.run([g for g, _ in local])
            reduced = sess.run([g for g, _ in pairs])
            sess.run(hvd.broadcast_global_variables(0))
            for _ in range(3):
                sess.run(train_op)
            end = sess.run(weights)
    for both, got in zip(_gathered(hvd, mine), reduced):
        np.testing.assert_allclose(got, both.mean(axis=0), rtol=1e-5)
    _assert_same_on_ranks(hvd, end)


def test_op_sum_and_compression(hvd, tf):
    with tf.Graph().as_default():
        loss, weights = _model(tf, hvd)
        local = tf.compat.v1.train.GradientDescentOptimizer(0.1).compute_gradients(loss, weights)
        summed = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                          op=hvd.Sum).compute_gradients(loss, weights)
        halves = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                          compression=hvd.Compression.fp16).compute_gradients(loss, weights)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            mine, got_sum, got_half = sess.run([[g for g, _ in p] for p in (local, summed, halves)])
    for both, s, h in zip(_gathered(hvd, mine), got_sum, got_half):
        np.testing.assert_allclose(s, both.sum(axis=0), rtol=1e-5)
        assert h.dtype == np.float32
        np.testing.assert_allclose(h, both.mean(axis=0), rtol=1e-2, atol=1e-2)


def test_sparse_gradients_allgathered_or_dense(hvd, tf):
    with tf.Graph().as_default():
        table = tf.compat.v1.get_variable("table", initializer=np.ones((6, 2), np.float32))
        rows = tf.constant([hvd.rank(), 3])
        loss = tf.reduce_sum(tf.gather(table, rows)) * float(hvd.rank() + 1)
        sparse = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0))
        dense = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0), sparse_as_dense=True)
        ((g_sparse, _),) = sparse.compute_gradients(loss, [table])
        ((g_dense, _),) = dense.compute_gradients(loss, [table])
        assert isinstance(g_sparse, tf.IndexedSlices) and not isinstance(g_dense, tf.IndexedSlices)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got_dense = sess.run(g_dense)
            got_sparse = sess.run(tf.convert_to_tensor(g_sparse))
    expected = np.zeros((6, 2), np.float32)
    expected[0] += 1 / 2
    expected[1] += 2 / 2
    expected[3] += (1 + 2) / 2
    np.testing.assert_allclose(got_dense, expected)
    np.testing.assert_allclose(got_sparse, expected)


@pytest.mark.parametrize("average", [False, True])
def test_backward_passes_per_step_accumulates_then_applies(hvd, tf, average):
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=np.zeros(3, np.float32))
        step = tf.compat.v1.placeholder(tf.float32, [])
        loss = tf.reduce_sum(w * step * float(hvd.rank() + 1))  # gradient: step * (rank + 1)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                       backward_passes_per_step=2, average_aggregated_gradients=average)
        global_step = tf.compat.v1.train.get_or_create_global_step()
        train_op = opt.minimize(loss, global_step=global_step)
        with tf.compat.v1.Session() as sess:
            sess.run([tf.compat.v1.global_variables_initializer(), tf.compat.v1.local_variables_initializer()])
            seen = []
            for s in (1.0, 2.0, 3.0, 4.0):
                sess.run(train_op, {step: s})
                seen.append(sess.run([w, global_step]))
    # mean over ranks of (rank + 1) is 1.5; steps 1+2, then 3+4, summed (or averaged over 2 passes)
    k = 2.0 if average else 1.0
    assert [int(g) for _, g in seen] == [1, 2, 3, 4]
    np.testing.assert_allclose(seen[0][0], np.zeros(3))
    np.testing.assert_allclose(seen[1][0], np.full(3, -1.5 * 3 / k))
    np.testing.assert_allclose(seen[2][0], np.full(3, -1.5 * 3 / k))
    np.testing.assert_allclose(seen[3][0], np.full(3, -1.5 * 10 / k))


def test_several_dtypes_in_one_step(hvd, tf):
    with tf.Graph().as_default():
        a = tf.compat.v1.get_variable("a", initializer=np.ones(4, np.float32))
        b = tf.compat.v1.get_variable("b", initializer=np.ones(5, np.float64))
        scale = float(hvd.rank() + 1)
        loss = tf.reduce_sum(a * scale) + tf.cast(tf.reduce_sum(b * scale * 2), tf.float32)
        pairs = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0)).compute_gradients(
            loss, [a, b])
        threads = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=4)  # independent ops may run at once
        with tf.compat.v1.Session(config=threads) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(5):
                ga, gb = sess.run([g for g, _ in pairs])
    np.testing.assert_allclose(ga, np.full(4, 1.5))
    assert gb.dtype == np.float64
    np.testing.assert_allclose(gb, np.full(5, 3.0))


def test_broadcast_global_variables_needs_a_graph(hvd, tf):
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        hvd.broadcast_global_variables(0)


@pytest.mark.parametrize("argument", [dict(device_dense="/gpu:0"), dict(num_groups=2), dict(groups=[[0]])])
def test_refused_arguments_say_so(hvd, tf, argument):
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match=f"{next(iter(argument))}=.* is not supported"):
            hvd.DistributedOptimizer(tf.compat.v1.train.AdagradOptimizer(0.01), **argument)
    with pytest.raises(ValueError, match="use_locking=True.*TF1 optimizers only"):
        import keras

        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), use_locking=True)


def test_backward_passes_per_step_needs_a_graph(hvd, tf):
    with pytest.raises(ValueError, match="backward_passes_per_step=2 needs a graph"):
        hvd.DistributedOptimizer(tf.compat.v1.train.AdagradOptimizer(0.01), backward_passes_per_step=2)


def test_eager_tf1_optimizer_reduces_too(hvd, tf):
    w = tf.Variable(np.zeros(2, np.float32))
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0))
    opt.minimize(lambda: tf.reduce_sum(w) * float(hvd.rank() + 1), var_list=[w])
    np.testing.assert_allclose(w.numpy(), np.full(2, -1.5))
