"""hvd.elastic on 2 ranks: commit, restore and sync of Python values, TensorFlow variables and a Keras 3
model with its optimizer (bit-exact), the reset loop of ``hvd.elastic.run`` (a failure raised on every
rank, a rank that resets while the other waits in a collective, a change of hosts), and the Keras
callbacks."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def keras(tf):
    import keras

    return keras


def model_and_optimizer(keras, seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(2)])
    return model, keras.optimizers.Adam(0.05)


def train_steps(tf, model, optimizer, steps, seed=7):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = rng.normal(size=(8, 4)).astype(np.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))


def values(variables):
    return [np.array(v.numpy(), copy=True) for v in variables]


def assert_bit_exact(before, after):
    assert len(before) == len(after)
    for a, b in zip(before, after):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_object_state_commit_restore_sync(hvd):
    state = hvd.elastic.ObjectState(epoch=hvd.rank() * 10, names=["a"])
    state.sync()  # rank 0's values everywhere
    assert (state.epoch, state.names) == (0, ["a"])
    state.epoch = 3
    state.commit()
    state.epoch, state.names = 99, ["changed"]
    state.restore()
    assert (state.epoch, state.names) == (3, ["a"])


def test_keras_state_restores_model_and_optimizer_bit_exact_and_syncs_from_rank_0(hvd, tf, keras):
    model, optimizer = model_and_optimizer(keras, seed=10 + hvd.rank())  # each rank starts elsewhere
    state = hvd.elastic.KerasState(model, optimizer, epoch=0)
    assert optimizer.built and len(optimizer.variables) > 2  # built at once: its slots are part of the commit
    state.sync()
    mine = values(model.variables + optimizer.variables)
    everyone = hvd.allgather_object(mine)
    assert_bit_exact(everyone[0], everyone[1])

    train_steps(tf, model, optimizer, 3)
    state.epoch = 1
    state.commit()
    committed = values(model.variables + optimizer.variables)
    assert int(optimizer.iterations.numpy()) == 3
    train_steps(tf, model, optimizer, 2, seed=8)
    state.epoch = 2
    assert not all(a.tobytes() == b.tobytes() for a, b in zip(committed, values(model.variables)))
    state.restore()
    assert_bit_exact(committed, values(model.variables + optimizer.variables))
    assert int(optimizer.iterations.numpy()) == 3 and state.epoch == 1


def test_tensorflow_state_of_variables(hvd, tf):
    v = tf.Variable(np.full(5, float(hvd.rank() + 1), np.float32))
    state = hvd.elastic.TensorFlowState([v], step=hvd.rank())
    state.sync()
    np.testing.assert_array_equal(v.numpy(), np.ones(5, np.float32))
    assert state.step == 0
    v.assign_add(np.ones(5, np.float32))
    state.commit()
    v.assign(np.zeros(5, np.float32))
    state.restore()
    np.testing.assert_array_equal(v.numpy(), np.full(5, 2.0, np.float32))


def test_run_restores_the_commit_resets_the_world_and_calls_again(hvd, tf):
    v = tf.Variable(np.zeros(3, np.float32))
    state = hvd.elastic.TensorFlowState([v], step=0)
    resets, calls = [], []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state, total):
        calls.append(state.step)
        while state.step < total:
            v.assign_add(hvd.allreduce(np.ones(3, np.float32), op=hvd.Sum))
            state.step += 1
            if state.step % 2 == 0:
                state.commit()
            if len(calls) == 1 and state.step == 3:  # a failure every rank sees, after an uncommitted step
                raise hvd.elastic.HorovodInternalError("simulated")
        return v.numpy()

    result = train(state, 5)
    assert calls == [0, 2] and resets == [2]  # the second call started from the commit of step 2
    np.testing.assert_array_equal(result, np.full(3, 10.0, np.float32))  # 5 steps of +2, none counted twice
    assert hvd.allreduce(np.array([1.0]), op=hvd.Sum)[0] == 2.0  # the new world works


def test_a_rank_that_resets_fails_the_others_collective_and_they_reset_with_it(hvd):
    state = hvd.elastic.ObjectState(step=0)
    calls, seen = [], []

    @hvd.elastic.run
    def train(state):
        calls.append(state.step)
        if len(calls) == 1 and hvd.rank() == 0:
            raise hvd.elastic.HorovodInternalError("rank 0 fails alone")
        try:
            return hvd.allreduce(np.array([1.0]), op=hvd.Sum, name="after_the_reset")[0]
        except hvd.elastic.HorovodInternalError as exc:  # rank 1 waited here for rank 0
            seen.append(str(exc))
            raise

    assert train(state) == 2.0
    assert calls == [0, 0]
    if hvd.rank() == 1:
        assert len(seen) == 1 and "rank 0 left allreduce('after_the_reset')" in seen[0], seen


def test_a_host_update_noted_on_rank_0_interrupts_every_rank_at_the_same_commit(hvd):
    state = hvd.elastic.ObjectState(step=0)
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(state.step)
        while state.step < 4:
            state.step += 1
            if len(calls) == 1 and state.step == 2 and hvd.rank() == 0:
                state.on_hosts_updated(1.0, hvd.elastic.HostUpdateResult.added)
            state.commit()
        return state.step

    assert train(state) == 4
    assert calls == [0, 2]  # no restore: the reset kept step 2 (committed when the interrupt was raised)


def test_keras_callbacks_commit_every_n_batches_and_track_batch_and_epoch(hvd, tf, keras):
    model, optimizer = model_and_optimizer(keras, seed=3)
    model.compile(optimizer=hvd.DistributedOptimizer(optimizer), loss="mse")
    model(np.zeros((1, 4), np.float32))
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    commits = []
    commit = state.commit
    state.commit = lambda: (commits.append((state.epoch, state.batch)), commit())
    x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    y = np.zeros((40, 2), np.float32)
    callbacks = [hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=3)]
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks, shuffle=False)
    # 5 batches an epoch, numbered from 0: a commit every 3rd batch, counted on across epochs (as Horovod's),
    # and one at each epoch's end, after the other callbacks moved batch and epoch on
    assert commits == [(0, 2), (1, 0), (1, 0), (1, 3), (2, 0)], commits
    assert (state.epoch, state.batch) == (2, 0)
    model.fit(x, y, batch_size=8, initial_epoch=state.epoch, epochs=3, verbose=0, callbacks=callbacks)
    assert state.epoch == 3
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)  # Horovod's examples: the rest
    assert state.epoch == 4
    with pytest.raises(ValueError, match="batches_per_commit"):
        hvd.elastic.CommitStateCallback(state, batches_per_commit=0)


def test_an_unbuilt_model_is_refused_with_what_to_do(hvd, keras):
    model = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="model.build"):
        hvd.elastic.KerasState(model, keras.optimizers.SGD())
