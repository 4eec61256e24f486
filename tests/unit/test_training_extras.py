"""The pure parts of the local-layer and SyncBatchNormalization support (no MPI, no engines);
tests/parallel/test_training_extras.py runs them on 2 ranks."""

from __future__ import annotations

import inspect

import pytest

keras = pytest.importorskip("keras")

from hvd_notebook.runtime.keras import callbacks, training  # noqa: E402  (after Keras is known to import)


def test_local_variables_are_matched_by_identity_and_layers_read_late():
    local = training.LocalVariables()
    var = keras.Variable(1.0)
    same_value = keras.Variable(1.0)
    local.register(var)
    layer = keras.layers.Dense(2)
    local.add_layers([layer])
    assert local.ids() == {id(var)}  # the layer has no weights yet
    layer.build((None, 3))
    assert local.ids() == {id(var), id(layer.kernel), id(layer.bias)}
    assert id(same_value) not in local.ids()


def test_local_layers_argument_as_horovod_reads_it():
    layer = keras.layers.Dense(1)
    assert training._local_layers(None) == []
    assert training._local_layers(layer) == [layer]
    assert training._local_layers((layer,)) == [layer]
    with pytest.raises(ValueError, match="All local layers must be of keras.layers.Layer type"):
        training._local_layers([layer, "dense"])


def test_local_variables_argument_of_the_broadcast_callback():
    def kept(local_variables):
        callback = callbacks.BroadcastGlobalVariablesCallback(0, local_variables=local_variables)
        return list(callback._local_vars.values())

    var = keras.Variable([1.0, 2.0])
    assert kept(None) == []
    assert kept(var) == [var]
    assert kept([var]) == [var]
    with pytest.raises(ValueError, match="All local variables must be"):
        kept([var, 3.0])


def test_batch_normalization_still_offers_the_hook_sync_batch_norm_overrides():
    # SyncBatchNormalization replaces Keras's _moments(inputs, mask): a Keras that renames it must fail here
    from hvd_notebook.runtime.keras.sync_batch_norm import SyncBatchNormalization

    base = keras.layers.BatchNormalization
    assert list(inspect.signature(base._moments).parameters) == ["self", "inputs", "mask"]
    assert "self._moments(inputs, mask)" in inspect.getsource(base.call)
    assert list(inspect.signature(SyncBatchNormalization._moments).parameters) == ["self", "inputs", "mask"]
