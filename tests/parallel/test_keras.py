"""Keras 3 training across 2 ranks: DistributedOptimizer, DistributedGradientTape,
callbacks, shard. Small models on synthetic data."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def keras(tf):
    import keras

    return keras


def data(n=64, features=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5).astype(np.int64)
    return x, y


def model_for(keras, seed, features=6, classes=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((features,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(classes, activation="softmax")])


def same_on_every_rank(hvd, arrays, rtol=0.0, atol=0.0):
    everyone = hvd.allgather_object([np.asarray(a) for a in arrays])
    for other in everyone[1:]:
        for a, b in zip(everyone[0], other):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def test_broadcast_callback_makes_weights_identical(hvd, keras):
    x, y = data()
    model = model_for(keras, seed=100 + hvd.rank())  # different initialisation on each rank
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                  loss="sparse_categorical_crossentropy")
    model.fit(*hvd.shard((x, y)), batch_size=8, epochs=2, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    same_on_every_rank(hvd, model.get_weights())
    same_on_every_rank(hvd, [v.numpy() for v in model.optimizer.variables])


def per_rank_batches(hvd, x, y, per_rank, ranks_share):
    """Rank r's rows so that step s of every rank together covers one global batch in order."""
    global_batch = per_rank * ranks_share
    rows = [i for s in range(len(x) // global_batch)
            for i in range(s * global_batch + hvd.rank() * per_rank * (ranks_share // hvd.size()),
                           s * global_batch + (hvd.rank() + 1) * per_rank * (ranks_share // hvd.size()))]
    return x[rows], y[rows]


@pytest.mark.parametrize("passes", [1, 2])
def test_two_ranks_equal_one_rank_with_the_global_batch(hvd, keras, passes):
    x, y = data(n=96)
    per_rank = 8
    global_batch = per_rank * hvd.size() * passes
    reference = model_for(keras, seed=1)
    reference.compile(keras.optimizers.SGD(0.2), loss="sparse_categorical_crossentropy")
    reference.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0)

    model = model_for(keras, seed=1)
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.2), backward_passes_per_step=passes,
                                           average_aggregated_gradients=True),
                  loss="sparse_categorical_crossentropy")
    xr, yr = per_rank_batches(hvd, x, y, per_rank, hvd.size() * passes)
    model.fit(xr, yr, batch_size=per_rank, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    same_on_every_rank(hvd, model.get_weights())



@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "subclass"])
def test_every_optimizer_trains(hvd, keras, name):
    x, y = hvd.shard(data(n=128))
    if name == "subclass":
        class MySGD(keras.optimizers.SGD):
            pass

        base = MySGD(0.1, momentum=0.9)
    elif name == "SGD":
        base = keras.optimizers.SGD(0.1, momentum=0.9)
    else:
        base = getattr(keras.optimizers, name)(0.01)
    opt = hvd.DistributedOptimizer(base)
    assert isinstance(opt, type(base)) and type(opt).__name__ == f"Distributed{type(base).__name__}"
    model = model_for(keras, seed=3)
    model.compile(opt, loss="sparse_categorical_crossentropy")
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert history.history["loss"][-1] < history.history["loss"][0]
    same_on_every_rank(hvd, model.get_weights(), rtol=1e-6)


def test_learning_rate_schedule_is_kept(hvd, keras):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(schedule))
    model = model_for(keras, seed=4)
    model.compile(opt, loss="sparse_categorical_crossentropy")
    model.fit(*hvd.shard(data()), batch_size=32, epochs=1, verbose=0)
    assert float(opt.learning_rate) == pytest.approx(0.1 * 0.5 ** int(opt.iterations))


def test_metric_average_callback(hvd, keras):
    seen = {}

    class Record(keras.callbacks.Callback):
        def __init__(self, key):
            super().__init__()
            self.key = key

        def on_epoch_end(self, epoch, logs=None):
            seen[self.key] = dict(logs)

    x, y = data(seed=hvd.rank())  # different data: different local metrics
    model = model_for(keras, seed=5)
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    model.fit(x, y, batch_size=16, epochs=1, verbose=0,
              callbacks=[Record("before"), hvd.callbacks.MetricAverageCallback(), Record("after")])
    everyone_before = hvd.allgather_object(seen["before"])
    for key in ("loss", "accuracy"):
        expected = np.mean([b[key] for b in everyone_before])
        assert seen["after"][key] == pytest.approx(expected)
    same_on_every_rank(hvd, [np.array([seen["after"]["loss"], seen["after"]["accuracy"]])])


@pytest.mark.parametrize("graph", [False, True])
def test_distributed_gradient_tape(hvd, tf, keras, graph):
    x, y = data(seed=10 + hvd.rank())
    model = model_for(keras, seed=6)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    def grads(distributed):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        if distributed:
            tape = hvd.DistributedGradientTape(tape)
        return tape.gradient(loss, model.trainable_variables)

    step = tf.function(grads) if graph else grads
    local = [g.numpy() for g in step(False)]
    reduced = [g.numpy() for g in step(True)]
    everyone = hvd.allgather_object(local)
    for i, r in enumerate(reduced):
        np.testing.assert_allclose(r, np.mean([e[i] for e in everyone], axis=0), rtol=1e-5, atol=1e-7)


def test_shard_and_scale_lr(hvd, tf):
    x = np.arange(11)
    parts = hvd.allgather_object(hvd.shard(x).tolist())
    assert parts == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]  # strided, remainder dropped
    xs, ys = hvd.shard((x, x * 10))
    assert (ys == xs * 10).all()
    ds = hvd.shard(tf.data.Dataset.range(5))
    assert [int(v) for v in ds] == ([0, 2, 4] if hvd.rank() == 0 else [1, 3])
    assert hvd.scale_lr(0.1) == pytest.approx(0.1 * hvd.size())
    assert hvd.scale_lr(0.1, rule="sqrt") == pytest.approx(0.1 * np.sqrt(hvd.size()))
    with pytest.raises(ValueError, match="'linear' or 'sqrt'"):
        hvd.scale_lr(0.1, rule="cubic")


def test_jit_compile_gives_a_clear_error(hvd, keras):
    model = model_for(keras, seed=7)
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="sparse_categorical_crossentropy",
                  jit_compile=True)
    with pytest.raises(hvd.XLAUnsupportedError, match=r"jit_compile=False"):
        model.fit(*hvd.shard(data()), batch_size=16, epochs=1, verbose=0)


class RecordLR:
    """Records the learning rate each training batch starts with."""

    def __init__(self, keras):
        outer = self
        self.rates = []

        class _CB(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                outer.rates.append(float(self.model.optimizer.learning_rate))

        self.callback = _CB()


def test_warmup_follows_goyal_et_al(hvd, keras):
    x, y = hvd.shard(data(n=64))  # 32 rows per rank, batch 8: 4 steps per epoch
    model = model_for(keras, seed=8)
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="sparse_categorical_crossentropy")
    record = RecordLR(keras)
    initial, warmup, steps, n = 0.4, 2, 4, hvd.size()
    model.fit(x, y, batch_size=8, epochs=3, verbose=0,
              callbacks=[hvd.callbacks.LearningRateWarmupCallback(initial, warmup_epochs=warmup), record.callback])
    expected = []
    for epoch in range(3):
        for batch in range(steps):
            if epoch < warmup:
                e = epoch + batch / steps + 1 / steps
                expected.append(initial / n * (e * (n - 1) / warmup + 1))
            else:
                expected.append(expected[-1])  # the schedule stops at the end of the warm-up
    np.testing.assert_allclose(record.rates, expected, rtol=1e-6)
    assert record.rates[0] == pytest.approx(initial / n * (0.25 * (n - 1) / warmup + 1))
    assert record.rates[warmup * steps - 1] == pytest.approx(initial)


def test_schedule_callback_staircase_and_smooth(hvd, keras):
    x, y = hvd.shard(data(n=64))
    for staircase in (True, False):
        model = model_for(keras, seed=9)
        model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="sparse_categorical_crossentropy")
        record = RecordLR(keras)
        cb = hvd.callbacks.LearningRateScheduleCallback(1.0, lambda e: 0.5 ** e, start_epoch=1, end_epoch=3,
                                                        staircase=staircase)
        model.fit(x, y, batch_size=8, epochs=4, verbose=0, callbacks=[cb, record.callback])
        by_epoch = [record.rates[i * 4:(i + 1) * 4] for i in range(4)]
        assert by_epoch[0] == [pytest.approx(0.1)] * 4  # before start_epoch: untouched
        if staircase:
            assert by_epoch[1] == [pytest.approx(0.5)] * 4 and by_epoch[2] == [pytest.approx(0.25)] * 4
        else:
            np.testing.assert_allclose(by_epoch[1], [0.5 ** (1 + b / 4) for b in range(4)], rtol=1e-6)
        assert by_epoch[3] == [pytest.approx(by_epoch[2][-1])] * 4  # after end_epoch: kept


def test_checkpoints_on_rank_0_and_resume(hvd, keras, tmp_path_factory):
    folder = hvd.broadcast_object(str(tmp_path_factory.mktemp("ckpt")), root_rank=0)
    x, y = hvd.shard(data(n=64))

    def fresh():
        model = model_for(keras, seed=11)
        model.compile(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="sparse_categorical_crossentropy")
        return model

    continuous = fresh()
    path = f"{folder}/rank{hvd.rank()}-epoch{{epoch}}.keras"
    continuous.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                   callbacks=[hvd.callbacks.ModelCheckpoint(path)])
    hvd.barrier()
    import os

    written = sorted(os.listdir(folder))
    assert written == ["rank0-epoch1.keras", "rank0-epoch2.keras"]  # rank 1 wrote nothing

    resumed = hvd.load_model(f"{folder}/rank0-epoch1.keras")
    assert type(resumed.optimizer).__name__ == "DistributedAdam"
    assert int(resumed.optimizer.iterations) == 4
    resumed.fit(x, y, batch_size=8, epochs=2, initial_epoch=1, shuffle=False, verbose=0)
    for a, b in zip(resumed.get_weights(), continuous.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    same_on_every_rank(hvd, resumed.get_weights())


def test_best_model_checkpoint_on_rank_0(hvd, keras, tmp_path_factory):
    folder = hvd.broadcast_object(str(tmp_path_factory.mktemp("best")), root_rank=0)
    x, y = hvd.shard(data(n=64))
    model = model_for(keras, seed=12)
    model.compile(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x, y),
              callbacks=[hvd.callbacks.BestModelCheckpoint(f"{folder}/best-rank{hvd.rank()}.keras")])
    hvd.barrier()
    import os

    assert sorted(os.listdir(folder)) == ["best-rank0.keras"]


def test_auto_jit_falls_back_without_xla(hvd, keras, monkeypatch):
    """Where a GPU is visible, Keras resolves jit_compile="auto" to XLA: pretend so on this CPU machine."""
    monkeypatch.setattr(keras.Model, "_resolve_auto_jit_compile", lambda self: True)
    plain = model_for(keras, seed=13)
    plain.compile(keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    assert plain.jit_compile is True  # models without DistributedOptimizer are left alone
    model = model_for(keras, seed=13)
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="sparse_categorical_crossentropy")
    assert model.jit_compile is False
    history = model.fit(*hvd.shard(data()), batch_size=16, epochs=2, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
