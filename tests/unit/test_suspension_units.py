"""A rank's namespace saved and restored (engine/suspension.py), in one process: what is kept, what is refused."""

from __future__ import annotations

import io
import os
import random
import socket
import stat

import numpy as np
import pytest

from hvd_notebook import private
from hvd_notebook.engine import suspension


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "rank0"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture(autouse=True)
def rank0(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "0")


def _round_trip(namespace, folder):
    report = suspension.save(namespace, str(folder))
    fresh: dict = {}
    restored = suspension.restore(fresh, str(folder))
    return report, restored, fresh


def test_shared_objects_stay_shared_and_engine_names_are_left_out(folder):
    shared = [1, 2, 3]
    namespace = {"a": shared, "b": shared, "nested": {"again": shared}, "np": np, "array": np.arange(4),
                 "hvd": object(), "In": ["x"], "_5": "out", "_i5": "in", "__builtins__": {},
                 "_1a2b3c4d_0123456789abcdef01234567_4242_7_args": ("folder",)}  # (ipyparallel's, the call's)
    report, restored, fresh = _round_trip(namespace, folder)
    assert fresh["a"] is fresh["b"] is fresh["nested"]["again"] and fresh["a"] == [1, 2, 3]
    assert fresh["np"] is np and fresh["array"].tolist() == [0, 1, 2, 3]
    assert sorted(fresh) == ["a", "array", "b", "nested", "np"]
    assert report["saved"] == restored["restored"] == ["a", "array", "b", "nested", "np"]
    assert report["rank"] == 0 and report["bytes"] > 0 and report["unsaved"] == {}


def test_what_cannot_be_saved_is_named_with_its_reason_and_the_rest_is_saved(folder):
    with open(folder.parent / "log.txt", "w") as log, socket.socket() as sock:
        namespace = {"log": log, "sock": sock, "gen": (i for i in range(3)), "weights": np.ones(3), "epoch": 7,
                     "pair": [log, 1]}
        report, restored, fresh = _round_trip(namespace, folder)
    assert sorted(report["unsaved"]) == ["gen", "log", "pair", "sock"]
    assert "generator" in report["unsaved"]["gen"] and "open file" in report["unsaved"]["log"]
    assert "socket" in report["unsaved"]["sock"]
    assert restored["unsaved"] == ["gen", "log", "pair", "sock"]
    assert fresh == {"weights": pytest.approx(np.ones(3)), "epoch": 7}


def test_the_rngs_go_on_where_they_were(folder):
    torch = pytest.importorskip("torch")
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    suspension.save({}, str(folder))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    suspension.restore({}, str(folder))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_another_ranks_state_is_refused_naming_both_ranks(folder, monkeypatch):
    suspension.save({"x": 1}, str(folder))
    monkeypatch.setenv("PMI_RANK", "1")
    with pytest.raises(suspension.RankMismatchError, match=r"rank 1 cannot restore .*state of rank 0"):
        suspension.restore({}, str(folder))


class _Planted:
    """Unpickled, it leaves a mark: what a hostile user's pickle would do."""

    def __reduce__(self):
        return (open, (os.environ["HVD_TEST_MARK"], "w"))


@pytest.mark.parametrize("how", ["file of another user", "folder others may write"])
def test_a_state_someone_else_could_have_written_is_never_unpickled(folder, monkeypatch, how):
    mark = folder.parent / "unpickled"
    monkeypatch.setenv("HVD_TEST_MARK", str(mark))
    suspension.save({"x": _Planted()}, str(folder))
    if how == "file of another user":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(folder / suspension.STATE_FILE, 65534, 65534)
    else:
        folder.chmod(0o777)
    with pytest.raises(private.UnsafePathError):
        suspension.restore({}, str(folder))
    assert not mark.exists()
    folder.chmod(0o700)
    os.chown(folder / suspension.STATE_FILE, os.geteuid(), os.getegid())
    suspension.restore({}, str(folder))  # (the same state, this user's alone: it is loaded)
    assert mark.exists()


def test_the_files_are_private(folder):
    suspension.save({"x": 1}, str(folder))
    for name in (suspension.STATE_FILE, suspension.REPORT_FILE):
        assert stat.S_IMODE(os.stat(folder / name).st_mode) == 0o600


def test_a_module_and_its_optimizer_stay_together_with_their_state(folder):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    scaler.scale(model(torch.ones(4, 3)).sum()).backward()
    scaler.step(opt), scaler.update(), sched.step()
    _, _, fresh = _round_trip({"model": model, "opt": opt, "sched": sched, "scaler": scaler}, folder)
    assert fresh["scaler"].get_scale() == scaler.get_scale() == 2048.0
    new_model, new_opt = fresh["model"], fresh["opt"]
    assert new_opt.param_groups[0]["params"][0] is new_model.weight and fresh["sched"].optimizer is new_opt
    assert new_opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert torch.equal(new_opt.state[new_model.weight]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"])
    assert torch.equal(new_model.weight, model.weight)


def test_reconcile_loads_into_what_the_replay_made_and_puts_plain_values_back(folder):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ddp_like = _Unpicklable(model)  # (stands for a DDP wrapper: unsaved, made again by the replay)
    suspension.save({"model": model, "wrapper": ddp_like, "epoch": 5, "history": [1.0]}, str(folder))
    namespace: dict = {}
    restored = suspension.restore(namespace, str(folder))
    assert restored["unsaved"] == ["wrapper"] and "wrapper" not in namespace
    # the replay of the cell "model = Linear(3, 2); wrapper = Wrapper(model); epoch = 0"
    namespace["model"] = torch.nn.Linear(3, 2)
    namespace["wrapper"] = _Unpicklable(namespace["model"])
    replayed, epoch_zero = namespace["model"], 0
    namespace["epoch"] = epoch_zero
    outcome = suspension.reconcile(namespace)
    assert outcome == {"loaded": ["model", "wrapper"], "kept_restored": ["epoch"], "not_loaded": {}}
    assert namespace["model"] is replayed and namespace["wrapper"].module is replayed
    assert torch.equal(replayed.weight, model.weight) and namespace["epoch"] == 5


class _Unpicklable:
    """A wrapper that holds what cannot be pickled (as DDP holds its process group) and has a state_dict."""

    def __init__(self, module):
        self.module = module
        self.lock = io.StringIO()

    def __reduce__(self):
        raise TypeError("cannot pickle 'ProcessGroup' object")

    def state_dict(self):
        return {f"module.{k}": v for k, v in self.module.state_dict().items()}

    def load_state_dict(self, state):
        self.module.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})


def test_a_keras_model_keeps_its_optimizer_its_elastic_state_and_the_tensorflow_rng(folder):
    keras = pytest.importorskip("keras")
    import tensorflow as tf

    from hvd_notebook.runtime.keras import elastic

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    model.compile(opt, loss="mse")
    x, y = np.random.rand(8, 4).astype("float32"), np.random.rand(8, 1).astype("float32")
    model.fit(x, y, epochs=2, verbose=0)
    state = elastic.KerasState(model, epoch=2)
    counter = tf.Variable(5.0)
    tf.random.get_global_generator().normal([1])
    suspension.save({"model": model, "opt": opt, "state": state, "counter": counter}, str(folder))
    expected_draw = tf.random.get_global_generator().normal([2]).numpy()
    namespace: dict = {}
    suspension.restore(namespace, str(folder))
    assert np.array_equal(tf.random.get_global_generator().normal([2]).numpy(), expected_draw)
    new_model, new_opt, new_state = namespace["model"], namespace["opt"], namespace["state"]
    assert new_model.optimizer is new_opt and new_state.model is new_model and new_state.epoch == 2
    assert int(new_opt.iterations) == int(opt.iterations) == 2
    for old, new in zip([*model.weights, *opt.variables], [*new_model.weights, *new_opt.variables], strict=True):
        assert np.array_equal(old.numpy(), new.numpy()), old.path
    assert float(namespace["counter"].numpy()) == 5.0
    new_model.layers[0].kernel.assign(np.zeros((4, 3)))
    new_state.restore()  # (back to the commit: the restored model's own variables)
    assert np.array_equal(new_model.layers[0].kernel.numpy(), model.layers[0].kernel.numpy())
    for m in (model, new_model):  # (one step on, alike: the momentum was kept)
        m.train_on_batch(x, y)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), new_model.get_weights(), strict=True))


def test_a_custom_loops_keras_optimizer_keeps_its_slots(folder):
    keras = pytest.importorskip("keras")
    import tensorflow as tf

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    opt = keras.optimizers.Adam(0.1)
    x = np.random.rand(8, 4).astype("float32")

    def step(m, o):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(m(x) ** 2)
        o.apply_gradients(zip(tape.gradient(loss, m.trainable_variables), m.trainable_variables))

    step(model, opt)
    namespace: dict = {}
    suspension.save({"model": model, "opt": opt}, str(folder))
    assert suspension.restore(namespace, str(folder))["lost"] == {}
    new_model, new_opt = namespace["model"], namespace["opt"]
    assert int(new_opt.iterations) == 1
    step(model, opt), step(new_model, new_opt)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), new_model.get_weights(), strict=True))
    namespace = {}
    suspension.save({"opt": opt}, str(folder))  # (without its model: its variables cannot be matched)
    assert list(suspension.restore(namespace, str(folder))["lost"]) == ["opt"]


def test_a_tf_data_iterator_is_named_as_not_saved(folder):
    tf = pytest.importorskip("tensorflow")
    iterator = iter(tf.data.Dataset.range(4))
    next(iterator)
    report = suspension.save({"it": iterator, "n": 1}, str(folder))
    assert list(report["unsaved"]) == ["it"] and report["saved"] == ["n"]


@pytest.mark.gpu
def test_tensors_on_a_gpu_are_saved_from_host(folder):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: tensors on it are moved to host to be saved")
    model = torch.nn.Linear(3, 2).cuda()
    suspension.save({"model": model, "t": torch.ones(2, device="cuda")}, str(folder))
    data = (folder / suspension.STATE_FILE).read_bytes()
    assert b"cuda" in data  # (the device is named, the data is the host's copy)
    namespace: dict = {}
    suspension.restore(namespace, str(folder))
    assert namespace["model"].weight.is_cuda and torch.equal(namespace["model"].weight, model.weight)
    assert namespace["t"].is_cuda


def test_the_noise_scale_estimate_is_kept(folder):
    from hvd_notebook.runtime.core import noise_scale

    estimator = noise_scale.NoiseScale(decay=0.5)
    for _ in range(3):
        noise_scale.record(estimator, local_sq=3.0, global_sq=2.0, ranks=2, batch=32)
    noise_scale.tell_batch(32)
    expected = noise_scale.noise_scale()
    suspension.save({"estimator": estimator}, str(folder))
    noise_scale._latest, noise_scale._told_batch = None, None
    namespace: dict = {}
    suspension.restore(namespace, str(folder))
    assert noise_scale.latest() is namespace["estimator"] and noise_scale.latest().steps == 3
    assert expected is not None and noise_scale.noise_scale() == expected


def test_keras_dropout_masks_and_unseeded_draws_go_on_alike(folder):
    keras = pytest.importorskip("keras")

    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dropout(0.5),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), loss="mse")
    x, y = np.random.rand(8, 4).astype("float32"), np.random.rand(8, 1).astype("float32")
    model.train_on_batch(x, y), keras.random.uniform((1,))
    suspension.save({"model": model}, str(folder))
    model.train_on_batch(x, y)
    expected = (model.get_weights(), keras.random.uniform((3,)).numpy())
    keras.utils.set_random_seed(99)
    namespace: dict = {}
    suspension.restore(namespace, str(folder))
    namespace["model"].train_on_batch(x, y)
    draws = keras.random.uniform((3,)).numpy()
    assert all(np.array_equal(a, b) for a, b in zip(namespace["model"].get_weights(), expected[0], strict=True))
    assert np.array_equal(draws, expected[1])


def test_what_ipython_puts_in_its_namespace_is_left_out(folder):
    from IPython.core.interactiveshell import InteractiveShell

    existed = InteractiveShell.initialized()  # (another test's shell, whose namespace may hold its own names)
    shell = InteractiveShell.instance()
    try:
        shell.run_cell("steps_to_keep = [1, 2]")
        report = suspension.save(shell.user_ns, str(folder))
    finally:
        shell.user_ns.pop("steps_to_keep", None)
        if not existed:
            InteractiveShell.clear_instance()  # (other tests expect no shell in this process)
    assert "steps_to_keep" in report["saved"] and "open" not in report["saved"]  # (not IPython's own open)
    assert not {"In", "Out", "exit", "get_ipython", "_ih"} & set(report["saved"])


def test_a_kept_state_that_does_not_fit_what_the_replay_made_is_named(folder):
    torch = pytest.importorskip("torch")
    suspension.save({"wrapper": _Unpicklable(torch.nn.Linear(3, 2)), "other": _Unpicklable(torch.nn.Linear(1, 1))},
                    str(folder))
    namespace: dict = {}
    suspension.restore(namespace, str(folder))
    namespace["wrapper"] = _Unpicklable(torch.nn.Linear(5, 2))  # (the replay made another shape; "other": nothing)
    outcome = suspension.reconcile(namespace)
    assert outcome["loaded"] == [] and sorted(outcome["not_loaded"]) == ["other", "wrapper"]
    assert "size mismatch" in outcome["not_loaded"]["wrapper"] and "did not make" in outcome["not_loaded"]["other"]
