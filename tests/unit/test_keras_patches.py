"""keras_patches' registry on stand-in classes (no Keras import): patch once, list, undo."""

from __future__ import annotations

import pytest

from hvd_notebook import keras_patches


class Base:
    def fit(self) -> str:
        return "base fit"


class Model(Base):
    def compile(self) -> str:
        return "compile"


def tagged(method):
    def wrapper(self, *args, **kwargs):
        return "patched " + method(self, *args, **kwargs)

    return wrapper


@pytest.fixture(autouse=True)
def clean_registry():
    keras_patches.undo()
    yield
    keras_patches.undo()


def test_patch_wraps_once_and_lists_what_it_patched():
    original_compile = Model.__dict__["compile"]
    assert keras_patches.patch(Model, "compile", tagged)
    assert not keras_patches.patch(Model, "compile", tagged)  # a second patch is a no-op
    assert Model().compile() == "patched compile"
    assert keras_patches.patched() == [f"{__name__}.Model.compile"]
    keras_patches.undo()
    assert Model.__dict__["compile"] is original_compile and Model().compile() == "compile"
    assert keras_patches.patched() == []


def test_undo_of_an_inherited_method_inherits_it_again():
    assert "fit" not in Model.__dict__
    keras_patches.patch(Model, "fit", tagged)
    assert Model().fit() == "patched base fit" and Base().fit() == "base fit"
    keras_patches.undo()
    assert "fit" not in Model.__dict__ and Model.fit is Base.fit


def test_undo_restores_in_reverse_order():
    keras_patches.patch(Model, "compile", tagged)
    keras_patches.patch(Base, "fit", tagged)
    keras_patches.patch(Model, "fit", tagged)  # wraps the already patched Base.fit
    assert Model().fit() == "patched patched base fit"
    keras_patches.undo()
    assert Model().fit() == "base fit" and Model().compile() == "compile"
    assert "fit" not in Model.__dict__


def test_the_real_keras_patches_come_off_again():
    keras = pytest.importorskip("keras")
    owner = next(cls for cls in keras.Model.__mro__ if "compile" in cls.__dict__)
    originals = {name: getattr(keras.Model, name) for name in ("fit", "evaluate", "predict")}
    original_compile = owner.__dict__["compile"]
    keras_patches.patch_progress(tagged)
    keras_patches.patch_compile()
    assert all(getattr(keras.Model, name) is not method for name, method in originals.items())
    assert owner.__dict__["compile"] is not original_compile
    assert len(keras_patches.patched()) == 4
    keras_patches.undo()
    assert all(getattr(keras.Model, name) is method for name, method in originals.items())
    assert owner.__dict__["compile"] is original_compile


def test_batch_normalization_takes_horovods_fused_false_and_refuses_fused_true():
    keras = pytest.importorskip("keras")
    import numpy as np

    keras_patches.patch_keras2_idioms()
    bn = keras.layers.BatchNormalization(axis=1, fused=False)  # (Horovod's SyncBatchNormalization test passes it)
    out = bn(np.ones((4, 2), np.float32), training=True)
    assert out.shape == (4, 2) and bn.get_config()["axis"] == 1
    assert keras.layers.BatchNormalization(1, momentum=0.5).axis == 1  # positional arguments still pass
    with pytest.raises(ValueError, match=r"fused=True\): Keras 3 has no fused batch normalization"):
        keras.layers.BatchNormalization(fused=True)
    keras_patches.undo()
    with pytest.raises(ValueError, match="Unrecognized keyword arguments"):  # Keras 3's own again
        keras.layers.BatchNormalization(fused=False)


def test_a_tf1_session_fetches_a_keras_variable_and_ref_gives_a_dict_key():
    tf = pytest.importorskip("tensorflow")
    import keras

    keras_patches.patch_keras2_idioms()
    with tf.Graph().as_default():
        bn = keras.layers.BatchNormalization()
        out = bn(tf.ones((4, 2)), training=True)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(out)
            assert session.run(bn.moving_variance).tolist() == [1.0, 1.0]
    v = keras.Variable([1.0])
    assert {v.ref(): "v"}[v.ref()] == "v" and v.ref() != keras.Variable([1.0]).ref()
    keras_patches.undo()
    assert "_as_graph_element" not in keras.Variable.__dict__ and not hasattr(v, "ref")
