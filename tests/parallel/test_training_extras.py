"""Horovod's remaining Keras training names across 2 ranks: PartialDistributedGradientTape,
PartialDistributedOptimizer (local layers), SyncBatchNormalization and
BroadcastGlobalVariablesCallback(local_variables=...). Every rank feeds its own data, so that a
gradient reduced where it should stay local (or the reverse) changes the figures."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def keras(tf):
    import keras

    return keras


@pytest.fixture(scope="module")
def hvd_keras(hvd):
    """Horovod's Keras module (``horovod.tensorflow.keras``, ``horovod.keras``)."""
    import hvd_notebook.runtime.keras as hvd_keras

    return hvd_keras


def everyone(hvd, arrays):
    """Each rank's list of arrays, indexed by rank."""
    return hvd.allgather_object([np.asarray(a) for a in arrays])


def mean_over_ranks(hvd, arrays):
    """The mean of each array over the ranks, computed here from every rank's copy."""
    theirs = everyone(hvd, arrays)
    return [np.mean([t[i] for t in theirs], axis=0) for i in range(len(arrays))]


def rank_data(hvd, n=6, features=3, seed=0):
    rng = np.random.default_rng(seed + hvd.rank())
    x = (rng.normal(size=(n, features)) + 2.0 * hvd.rank()).astype(np.float32)
    y = rng.normal(size=(n, 1)).astype(np.float32)
    return x, y


def two_layer_model(keras, seed=1):
    keras.utils.set_random_seed(seed)  # the same weights on every rank
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])


def plain_gradients(tf, model, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


# ------------------------------------------------------------------ PartialDistributedGradientTape
@pytest.mark.parametrize("scale", [True, False])
@pytest.mark.parametrize("in_function", [False, True])
def test_partial_tape_reduces_all_but_the_local_layer(hvd, tf, keras, scale, in_function):
    x, y = rank_data(hvd)
    model = two_layer_model(keras)
    own = plain_gradients(tf, model, x, y)
    mean = mean_over_ranks(hvd, own)

    def gradients(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = hvd.PartialDistributedGradientTape(tape, local_layers=model.layers[1], scale_local_gradients=scale)
        return tape.gradient(loss, model.trainable_variables)

    step = tf.function(gradients) if in_function else gradients
    grads = [g.numpy() for g in step(tf.constant(x), tf.constant(y))]
    for g, m in zip(grads[:2], mean[:2]):  # the first layer's kernel and bias: averaged
        np.testing.assert_allclose(g, m, rtol=1e-5, atol=1e-6)
    for g, o in zip(grads[2:], own[2:]):  # the local layer's: this rank's own
        np.testing.assert_allclose(g, o / hvd.size() if scale else o, rtol=1e-5, atol=1e-6)
    theirs = everyone(hvd, grads)
    assert not np.allclose(theirs[0][2], theirs[1][2])  # the local gradients differ between ranks
    np.testing.assert_allclose(theirs[0][0], theirs[1][0], rtol=1e-6)


def test_registered_local_source_and_split_gradients(hvd, tf, keras):
    x, y = rank_data(hvd, seed=5)
    model = two_layer_model(keras)
    own = plain_gradients(tf, model, x, y)
    mean = mean_over_ranks(hvd, own)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    tape = hvd.DistributedGradientTape(tape)
    bias = model.layers[0].bias
    tape.register_local_source(bias)
    local, shared = tape.get_local_and_global_gradients(loss, model.trainable_variables)
    assert [v is bias for v, _ in local] == [True]
    np.testing.assert_allclose(local[0][1].numpy(), own[1] / hvd.size(), rtol=1e-5, atol=1e-6)
    assert len(shared) == 3
    for (_, g), m in zip(shared, [mean[0], mean[2], mean[3]]):
        np.testing.assert_allclose(g.numpy(), m, rtol=1e-5, atol=1e-6)


def test_partial_tape_without_local_layers_is_the_distributed_tape(hvd, tf, keras):
    x, y = rank_data(hvd, seed=9)
    model = two_layer_model(keras)
    mean = mean_over_ranks(hvd, plain_gradients(tf, model, x, y))
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    grads = hvd.PartialDistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    for g, m in zip(grads, mean):
        np.testing.assert_allclose(g.numpy(), m, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ PartialDistributedOptimizer
@pytest.mark.parametrize("scale", [True, False])
def test_partial_optimizer_one_step_of_fit(hvd, tf, keras, scale):
    x, y = rank_data(hvd, n=8, seed=20)
    lr = 0.1
    model = two_layer_model(keras, seed=3)
    before = [w.copy() for w in model.get_weights()]
    own = plain_gradients(tf, model, x, y)
    mean = mean_over_ranks(hvd, own)
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(lr), local_layers=[model.layers[1]],
                                          scale_local_gradients=scale)
    model.compile(opt, loss="mse")
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    after = model.get_weights()
    for w0, w1, g in zip(before[:2], after[:2], mean[:2]):
        np.testing.assert_allclose(w1, w0 - lr * g, rtol=1e-5, atol=1e-6)
    for w0, w1, g in zip(before[2:], after[2:], own[2:]):
        np.testing.assert_allclose(w1, w0 - lr * (g / hvd.size() if scale else g), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("passes", [1, 2])
def test_partial_optimizer_shares_all_but_the_local_layers(hvd, hvd_keras, tf, keras, passes):
    x, y = rank_data(hvd, n=16, seed=30)
    model = two_layer_model(keras, seed=4)
    if passes == 1:
        opt = hvd_keras.PartialDistributedOptimizer(keras.optimizers.Adam(0.01), local_layers=model.layers[1])
    else:  # the optimizer's own register_local_var, with gradient accumulation
        opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), backward_passes_per_step=passes)
        for var in model.layers[1].trainable_weights:
            opt.register_local_var(var)
    model.compile(opt, loss="mse")
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    weights = everyone(hvd, model.get_weights())
    for a, b in zip(weights[0][:2], weights[1][:2]):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    for a, b in zip(weights[0][2:], weights[1][2:]):
        assert not np.allclose(a, b)


def test_partial_optimizer_validates_its_arguments(hvd, tf, keras):
    opt = keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="local layers must be"):
        hvd.PartialDistributedOptimizer(opt, local_layers=["not a layer"])
    with pytest.raises(ValueError, match="local layers must be"):
        hvd.PartialDistributedGradientTape(tf.GradientTape(), local_layers=[3])
    with pytest.raises(ValueError, match="op=hvd.Average or hvd.Sum"):
        hvd.PartialDistributedOptimizer(opt, op=hvd.Adasum)
    with pytest.raises(ValueError, match=r"PartialDistributedOptimizer\(device_dense='/gpu:0'\).*omit it"):
        hvd.PartialDistributedOptimizer(opt, device_dense="/gpu:0")
    with pytest.raises(ValueError, match=r"PartialDistributedGradientTape\(groups=2\).*HOROVOD_FUSION_THRESHOLD"):
        hvd.PartialDistributedGradientTape(tf.GradientTape(), groups=2)
    with pytest.raises(TypeError, match="wraps a Keras optimizer, not GradientDescentOptimizer"):
        hvd.PartialDistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))


# ------------------------------------------------------------------ SyncBatchNormalization
def per_rank(hvd, shape, seed):
    """Arrays for every rank (rank r has 3 + 2r rows, around 3r), and this rank's rows in their concatenation."""
    arrays = []
    for r in range(hvd.size()):
        rng = np.random.default_rng(seed + r)
        arrays.append((rng.normal(size=(3 + 2 * r, *shape)) * (1 + r) + 3.0 * r).astype(np.float32))
    start = sum(len(a) for a in arrays[:hvd.rank()])
    return arrays, slice(start, start + len(arrays[hvd.rank()]))


@pytest.mark.parametrize("shape", [(4,), (2, 2, 3)])
@pytest.mark.parametrize("in_function", [False, True])
def test_sync_batch_norm_is_batch_norm_of_the_global_batch(hvd, tf, keras, shape, in_function):
    batches, mine = per_rank(hvd, shape, seed=40)
    weights, _ = per_rank(hvd, shape, seed=60)  # each rank's loss: sum(output * weights)
    config = dict(momentum=0.5, gamma_initializer="random_normal", beta_initializer="random_normal")
    sync, plain = hvd.SyncBatchNormalization(**config), keras.layers.BatchNormalization(**config)
    sync.build((None, *shape))
    plain.build((None, *shape))
    plain.set_weights(sync.get_weights())

    def forward(layer, inputs, w):
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            out = layer(inputs, training=True)
            loss = tf.reduce_sum(out * w)
        return out, tape.gradient(loss, inputs)

    run = tf.function(forward) if in_function else forward
    out, grad = run(sync, tf.constant(batches[hvd.rank()]), tf.constant(weights[hvd.rank()]))
    # the same layer on every rank's rows at once, with the loss of every rank's rows
    expected, expected_grad = run(plain, tf.constant(np.concatenate(batches)), tf.constant(np.concatenate(weights)))
    np.testing.assert_allclose(out.numpy(), expected.numpy()[mine], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(grad.numpy(), expected_grad.numpy()[mine], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(sync.moving_mean.numpy(), plain.moving_mean.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sync.moving_variance.numpy(), plain.moving_variance.numpy(), rtol=1e-4, atol=1e-4)
    # inference: the moving statistics, as BatchNormalization
    x = tf.constant(batches[hvd.rank()])
    np.testing.assert_allclose(sync(x, training=False).numpy(), plain(x, training=False).numpy(),
                               rtol=1e-4, atol=1e-4)


def test_sync_batch_norm_in_fit_keeps_every_rank_in_step(hvd, hvd_keras, tf, keras):
    x, y = rank_data(hvd, n=12, seed=50)
    keras.utils.set_random_seed(8)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), hvd_keras.SyncBatchNormalization(),
                              keras.layers.Dense(1)])
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    weights = everyone(hvd, model.get_weights())  # moving statistics included
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    restored = keras.layers.deserialize(keras.layers.serialize(model.layers[1]))
    assert type(restored) is hvd.SyncBatchNormalization


def test_sync_batch_norm_refuses_fused_and_synchronized(hvd, tf, keras):
    for fused in (True, None):
        with pytest.raises(ValueError, match="does not support fused=True"):
            hvd.SyncBatchNormalization(fused=fused)
    with pytest.raises(ValueError, match="synchronized=True.*omit it"):
        hvd.SyncBatchNormalization(synchronized=True)


# ------------------------------------------------------------------ BroadcastGlobalVariablesCallback
def test_broadcast_callback_leaves_local_variables_alone(hvd, tf, keras):
    root = hvd.size() - 1
    keras.utils.set_random_seed(100 + hvd.rank())  # different weights on every rank
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), keras.layers.Dense(2), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.0), loss="mse")  # no update: only the broadcast changes weights
    before = everyone(hvd, model.get_weights())
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(root, local_variables=model.layers[0].variables)
    callback.register_local_var(model.layers[1].bias)
    x, y = rank_data(hvd, n=4)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[callback])
    after = model.get_weights()
    local = {0, 1, 3}  # the first layer's kernel and bias, the second's bias
    for i, w in enumerate(after):
        np.testing.assert_array_equal(w, before[hvd.rank() if i in local else root][i])
    assert not np.allclose(before[0][0], before[1][0])  # so the test can tell a broadcast apart


def test_broadcast_callback_validates_local_variables(hvd, tf, keras):
    with pytest.raises(ValueError, match="local variables must be"):
        hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[np.ones(2)])
    variable = tf.Variable(1.0)
    hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=variable)  # one variable alone
