"""Keras 2 (``tf_keras``, ``TF_USE_LEGACY_KERAS=1``) training across 2 ranks, as Horovod users wrote it for
TensorFlow 2.15: ``DistributedOptimizer`` over Keras 2's optimizers (the newer ones and ``legacy``) in
``model.fit``, gradient accumulation, the callbacks, ``load_model``, ``SyncBatchNormalization``. What Horovod's
own Keras tests cover runs through benchmarks/horovod_suite.py (docs/coming-from-horovod.md)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from test_keras import same_on_every_rank

# this file has a world of its own (tests/integration/test_parallel.py): TensorFlow is imported after this line
assert "tensorflow" not in sys.modules, "test_keras2.py must run in a process of its own"
os.environ["TF_USE_LEGACY_KERAS"] = "1"


@pytest.fixture(scope="module")
def keras(tf):
    import tf_keras

    assert tf.keras.Model is tf_keras.Model  # tf.keras is Keras 2 here
    return tf.keras


def data(n=64, features=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5).astype(np.int64)
    return x, y


def model_for(keras, seed, features=6, classes=3, layers=()):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((features,)), keras.layers.Dense(8, activation="tanh"), *layers,
                             keras.layers.Dense(classes, activation="softmax")])


def rank_rows(hvd, x, y, per_rank):
    """Rank r's rows such that step s of all ranks together is the s-th global batch, in order."""
    rows = [i for s in range(len(x) // (per_rank * hvd.size()))
            for i in range(s * per_rank * hvd.size() + hvd.rank() * per_rank,
                           s * per_rank * hvd.size() + (hvd.rank() + 1) * per_rank)]
    return x[rows], y[rows]


@pytest.mark.parametrize("kind", ["SGD", "legacy.SGD"])
@pytest.mark.parametrize("passes", [1, 2])
def test_two_ranks_equal_one_rank_with_the_global_batch(hvd, keras, kind, passes):
    optimizers = keras.optimizers.legacy if kind.startswith("legacy") else keras.optimizers
    x, y = data(n=96)
    per_rank = 8
    reference = model_for(keras, seed=1)
    reference.compile(optimizers.SGD(0.2), loss="sparse_categorical_crossentropy")
    reference.fit(x, y, batch_size=per_rank * hvd.size() * passes, epochs=1, shuffle=False, verbose=0)

    model = model_for(keras, seed=1)
    opt = hvd.DistributedOptimizer(optimizers.SGD(0.2), backward_passes_per_step=passes,
                                   average_aggregated_gradients=True)
    assert type(opt).__name__ == "SGD" and isinstance(opt, optimizers.SGD)  # Horovod's naming: saved models load
    model.compile(opt, loss="sparse_categorical_crossentropy", experimental_run_tf_function=False)
    model.fit(*rank_rows(hvd, x, y, per_rank), batch_size=per_rank, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    same_on_every_rank(hvd, model.get_weights())
    if passes > 1:
        assert int(opt.iterations) == 96 // (per_rank * hvd.size())  # every pass counts, as in Horovod
        assert int(opt._agg_helper.counter) == 0


@pytest.mark.parametrize("settings", [dict(gradient_predivide_factor=2.0), dict(op="Sum"),
                                      dict(compression="fp16"), dict(sparse_as_dense=True)])
def test_reduction_settings(hvd, keras, settings):
    settings = dict(settings)
    if settings.get("op") == "Sum":
        settings["op"] = hvd.Sum
    if settings.get("compression") == "fp16":
        settings["compression"] = hvd.Compression.fp16
    x, y = hvd.shard(data(n=64))
    model = model_for(keras, seed=4 + hvd.rank())
    model.compile(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), **settings),
                  loss="sparse_categorical_crossentropy")
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert history.history["loss"][-1] < history.history["loss"][0]
    same_on_every_rank(hvd, model.get_weights(), rtol=1e-6)
    same_on_every_rank(hvd, [v.numpy() for v in model.optimizer.variables()])


def test_broadcast_callback_with_a_model_built_by_its_first_batch(hvd, keras):
    # Keras 2's Sequential without an input shape (Horovod's MNIST examples) has no weights before fit
    x, y = hvd.shard(data(n=64))
    keras.utils.set_random_seed(20 + hvd.rank())
    model = keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3, activation="softmax")])
    model.compile(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    same_on_every_rank(hvd, model.get_weights(), rtol=1e-6)


def test_fit_reports_the_noise_scale_and_averages_metrics(hvd, keras):
    x, y = hvd.shard(data(n=256, seed=hvd.rank()))
    model = model_for(keras, seed=5)
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="sparse_categorical_crossentropy")
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()])
    last = history.history["noise_scale"][-1]
    assert np.isfinite(last) and last > 0, history.history["noise_scale"]
    assert last == pytest.approx(model.optimizer.noise_scale())  # the optimizer's own figure, put in the logs
    same_on_every_rank(hvd, [history.history["loss"]])  # averaged over the ranks' different data


def test_fit_measures_the_known_noise_scale(hvd, keras, monkeypatch):
    # test_noise_scale.py's least squares at learning rate 0, whose noise scale is known, through Keras 2's fit
    from test_noise_scale import B_SIMPLE, BATCH, DELTA, W_STAR, D, batches

    monkeypatch.setenv("HVD_NOTEBOOK_NOISE_SCALE_DECAY", "0.998")  # a long average: the estimate's noise a few %
    x, y = batches(hvd.rank())
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].kernel.assign((W_STAR + DELTA).astype(np.float32)[:, None])
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    figure = history.history["noise_scale"][-1]
    assert figure == pytest.approx(B_SIMPLE, rel=0.10), (figure, B_SIMPLE)
    assert figure == pytest.approx(hvd.noise_scale())
    same_on_every_rank(hvd, [np.float64(figure)], rtol=1e-3)


def test_warmup_and_schedule_set_the_learning_rate(hvd, keras):
    x, y = hvd.shard(data(n=64))
    model = model_for(keras, seed=6)
    opt = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(0.1, momentum=0.9))
    model.compile(opt, loss="sparse_categorical_crossentropy")
    seen = []
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(float(opt.lr)))
    model.fit(x, y, batch_size=8, epochs=4, verbose=0, callbacks=[
        hvd.callbacks.LearningRateWarmupCallback(0.1 * hvd.size(), warmup_epochs=2),
        hvd.callbacks.LearningRateScheduleCallback(0.1 * hvd.size(), 0.5, start_epoch=2), record])
    n = hvd.size()
    # warm-up: at the end of epoch e, initial / n * ((e + 1) * (n - 1) / 2 + 1); then the schedule's half
    np.testing.assert_allclose(seen, [0.1 * ((n - 1) / 2 + 1), 0.1 * n, 0.05 * n, 0.05 * n], rtol=1e-5)
    assert np.isclose(float(opt.momentum), 0.9)  # the momentum correction is undone after its step


def test_checkpoint_on_rank_0_and_load_model_rewraps(hvd, keras, tmp_path_factory):
    folder = hvd.broadcast_object(str(tmp_path_factory.mktemp("k2ckpt")), root_rank=0)
    x, y = hvd.shard(data(n=64))
    class MyAdam(keras.optimizers.legacy.Adam):  # the user's own: load_model(custom_optimizers=[MyAdam])
        pass

    # (tf_keras's .keras format keeps no state of a legacy optimizer, with or without Horovod: h5 does)
    for kind, suffix in (("new", "keras"), ("legacy", "h5"), ("custom", "h5")):
        optimizers = keras.optimizers if kind == "new" else keras.optimizers.legacy
        model = model_for(keras, seed=7)
        base = MyAdam(0.01) if kind == "custom" else optimizers.Adam(0.01)
        model.compile(hvd.DistributedOptimizer(base), loss="sparse_categorical_crossentropy")
        path = f"{folder}/{kind}-rank{hvd.rank()}.{suffix}"
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x, y),
                  callbacks=[hvd.callbacks.BestModelCheckpoint(path, monitor="val_loss")])
        hvd.barrier()
        assert sorted(f for f in os.listdir(folder) if f.startswith(kind)) == [f"{kind}-rank0.{suffix}"]
        loaded = hvd.load_model(f"{folder}/{kind}-rank0.{suffix}", custom_optimizers=[MyAdam])
        assert isinstance(loaded.optimizer, MyAdam if kind == "custom" else optimizers.Adam)
        assert hasattr(loaded.optimizer, "_hvd_settings")  # wrapped again
        assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations)
        loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)  # trains on, reduced over the ranks
        same_on_every_rank(hvd, loaded.get_weights(), rtol=1e-6)


def test_sync_batch_normalization_uses_the_global_batch(hvd, keras, tf):
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(loc=hvd.rank() * 3.0, size=(8 + 4 * hvd.rank(), 5)).astype(np.float32)  # unequal batches
    layer = hvd.SyncBatchNormalization(momentum=0.0, epsilon=0.0, center=False, scale=False)
    out = layer(x, training=True).numpy()
    everything = np.concatenate(hvd.allgather_object(x))
    mean, var = everything.mean(0), everything.var(0)
    np.testing.assert_allclose(out, (x - mean) / np.sqrt(var), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(layer.moving_mean.numpy(), mean, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="fused=True"):
        hvd.SyncBatchNormalization(fused=True)


def test_elastic_state_with_a_legacy_optimizer(hvd, keras):
    x, y = hvd.shard(data(n=32))
    model = model_for(keras, seed=8 + hvd.rank())
    model.compile(hvd.DistributedOptimizer(keras.optimizers.legacy.Adam(0.01)), loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # the legacy optimizer makes its slots in its first update
    state = hvd.elastic.KerasState(model, batch=3 + hvd.rank())
    state.sync()
    same_on_every_rank(hvd, model.get_weights() + [v.numpy() for v in model.optimizer.variables()])
    assert state.batch == 3
    before = model.get_weights()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    state.restore()
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)


def test_what_is_no_optimizer_is_refused_saying_so(hvd, keras):
    with pytest.raises(TypeError, match="DistributedOptimizer wraps a Keras optimizer"):
        hvd.DistributedOptimizer(object())


def test_broadcast_global_variables_runs_in_keras_s_own_session(hvd, tf):
    import hvd_notebook.runtime.keras as hvd_keras  # (horovod.tensorflow.keras)

    # a TF1 graph with no default session: Horovod's Keras module runs the broadcast in K.get_session()
    with tf.Graph().as_default():
        variable = tf.compat.v1.Variable(float(hvd.rank() + 1))
        session = tf.compat.v1.keras.backend.get_session()
        session.run(tf.compat.v1.global_variables_initializer())
        hvd_keras.broadcast_global_variables(0)
        assert session.run(variable) == 1.0
    with pytest.raises(RuntimeError, match="does not support eager execution"):
        hvd_keras.broadcast_global_variables(0)
