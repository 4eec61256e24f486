"""The gradient noise scale against a known answer, through every path that measures it.

Least squares with Gaussian inputs: x ~ N(0, I_d), y = x.w* + e, e ~ N(0, s^2), loss 1/2 (x.w - y)^2.
At a fixed point w = w* + delta (learning rate 0) a sample's gradient is x (x.delta - e), so

    G = delta,   Sigma = E[g g^T] - G G^T = (|delta|^2 + s^2) I + delta delta^T   (Isserlis),
    B_simple = tr(Sigma) / |G|^2 = ((d + 1) |delta|^2 + d s^2) / |delta|^2.

Each rank draws its own batches; the estimate after many steps must land within 10% of B_simple, on
2 ranks and on 4 (test_parallel.py runs this file in both worlds), and Keras's ``fit``, the tape and
PyTorch's DistributedOptimizer must agree on the same data."""

from __future__ import annotations

import numpy as np
import pytest

D, SIGMA, BATCH, STEPS = 8, 1.0, 32, 1500
DELTA = np.ones(D) / np.sqrt(D)  # |delta|^2 = 1
W_STAR = np.linspace(-1.0, 1.0, D)
B_SIMPLE = ((D + 1) * 1.0 + D * SIGMA**2) / 1.0  # 17


@pytest.fixture(scope="module", autouse=True)
def slow_decay():
    # a long average: the known answer is checked to 10%, so the estimate's own noise must be a few %
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HVD_NOTEBOOK_NOISE_SCALE_DECAY", "0.998")
        yield


def batches(rank, steps=STEPS, batch=BATCH, seed=0):
    """This rank's ``steps`` batches, the same on every run (a seed per rank)."""
    rng = np.random.default_rng([seed, rank])
    x = rng.normal(size=(steps * batch, D)).astype(np.float32)
    y = (x @ W_STAR + SIGMA * rng.normal(size=steps * batch)).astype(np.float32)
    return x, y[:, None]


def check(hvd, value):
    values = hvd.allgather_object(value)
    assert all(v == pytest.approx(values[0], rel=1e-3) for v in values), values  # every rank's alike
    assert value == pytest.approx(B_SIMPLE, rel=0.10), (value, B_SIMPLE, hvd.size())
    return value


@pytest.fixture(scope="module")
def keras_value(hvd, tf):
    import keras

    x, y = batches(hvd.rank())
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].kernel.assign((W_STAR + DELTA).astype(np.float32)[:, None])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.0))
    model.compile(opt, loss="mse")  # (twice the gradient of 1/2 (x.w - y)^2: the ratio is the same)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model, opt, history


def test_keras_fit_measures_the_known_noise_scale(hvd, keras_value):
    model, opt, history = keras_value
    check(hvd, hvd.noise_scale())  # fit tells the optimizer its batch: no batch_size needed
    assert opt.noise_scale() == hvd.noise_scale()
    assert history.history["noise_scale"][-1] == pytest.approx(hvd.noise_scale())


def test_the_tape_measures_the_known_noise_scale_as_keras(hvd, tf, keras_value):
    model, opt, _ = keras_value
    x, y = batches(hvd.rank())
    w = tf.Variable((W_STAR + DELTA).astype(np.float32)[:, None])

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = 0.5 * tf.reduce_mean(tf.square(xb @ w - yb))
        return hvd.DistributedGradientTape(tape).gradient(loss, [w])  # a new tape each step, as in Horovod's loops

    for i in range(STEPS):
        step(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
    tape_value = hvd.noise_scale(batch_size=BATCH)  # a tape cannot tell its batch
    check(hvd, tape_value)
    assert tape_value == pytest.approx(opt.noise_scale(), rel=1e-3)  # same data, same figure


def torch_steps(thvd, x, y, steps=STEPS, **options):
    """``steps`` steps of PyTorch's DistributedOptimizer at learning rate 0 (each of ``BATCH`` samples a
    rank, in ``backward_passes_per_step`` passes); the optimizer."""
    import torch

    w = torch.nn.Parameter(torch.tensor((W_STAR + DELTA)[:, None], dtype=torch.float32))
    opt = thvd.DistributedOptimizer(torch.optim.SGD([w], lr=0.0), named_parameters=[("w", w)], **options)
    passes = options.get("backward_passes_per_step", 1)
    per = BATCH // passes
    for i in range(steps):
        opt.zero_grad()
        for k in range(passes):
            lo = i * BATCH + k * per
            xb, yb = torch.from_numpy(x[lo:lo + per]), torch.from_numpy(y[lo:lo + per])
            (0.5 * ((xb @ w - yb) ** 2).mean()).backward()  # (summed over the passes, as Horovod's)
        opt.step()
    return opt


@pytest.fixture(scope="module")
def thvd(hvd):
    import hvd_notebook.runtime.torch as thvd

    thvd.init()
    return thvd


def test_torch_measures_the_known_noise_scale_as_keras(hvd, thvd, keras_value):
    _, keras_opt, _ = keras_value
    x, y = batches(hvd.rank())
    opt = torch_steps(thvd, x, y)
    value = check(hvd, thvd.noise_scale(batch_size=BATCH))  # PyTorch's optimizer cannot tell its batch
    assert value == opt.noise_scale(BATCH)
    assert value == pytest.approx(keras_opt.noise_scale(), rel=1e-3)  # the Keras and PyTorch paths agree


FEW = 200  # steps where figures are compared with each other, not with the known answer


@pytest.fixture(scope="module")
def torch_reference(hvd, thvd):
    x, y = batches(hvd.rank(), seed=1)
    return torch_steps(thvd, x, y, steps=FEW).noise_scale(BATCH)


@pytest.mark.parametrize("option", ["backward_passes_per_step", "op", "compression", "gradient_predivide_factor"])
def test_torch_options_keep_the_figure(hvd, thvd, option, torch_reference):
    # 4 accumulated passes of BATCH/4 samples are one rank's batch of BATCH; a sum over ranks, fp16 on the
    # wire and a predivided average come back to the same averages
    value = {"backward_passes_per_step": 4, "op": thvd.Sum, "compression": thvd.Compression.fp16,
             "gradient_predivide_factor": 2.0}[option]
    x, y = batches(hvd.rank(), seed=1)
    opt = torch_steps(thvd, x, y, steps=FEW, **{option: value})
    figure = opt.noise_scale(BATCH // opt.backward_passes_per_step)
    assert figure == pytest.approx(torch_reference, rel=2e-2 if option == "compression" else 1e-3)


def test_keras_accumulated_passes_count_as_one_batch(hvd, tf, torch_reference):
    import keras

    x, y = batches(hvd.rank(), seed=1)
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].kernel.assign((W_STAR + DELTA).astype(np.float32)[:, None])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.0), backward_passes_per_step=4)
    model.compile(opt, loss="mse")
    model.fit(x[:FEW * BATCH], y[:FEW * BATCH], batch_size=BATCH // 4, epochs=1, shuffle=False, verbose=0)
    assert opt.noise_scale() == pytest.approx(torch_reference, rel=1e-3)


def keras_figure(hvd, make_optimizer, sparse=False):
    """The noise scale a Keras fit of ``FEW`` steps at learning rate 0 measures (a model with an embedding
    where ``sparse``: its gradient is a ``tf.IndexedSlices``)."""
    import keras

    keras.utils.set_random_seed(3)  # the same weights on every rank and in every call
    rng = np.random.default_rng([2, hvd.rank()])
    if sparse:
        x = rng.integers(0, 20, size=(FEW * BATCH, 3))
        inputs = keras.Input((3,), dtype="int32")
        hidden = keras.layers.Flatten()(keras.layers.Embedding(20, 4)(inputs))
    else:
        x = rng.normal(size=(FEW * BATCH, D)).astype(np.float32)
        inputs = keras.Input((D,))
        hidden = inputs
    y = rng.normal(size=(FEW * BATCH, 1)).astype(np.float32)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    opt = make_optimizer(keras)
    model.compile(opt, loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return opt.noise_scale()


def test_sparse_gradients_count_as_their_dense_form(hvd, tf):
    sparse = keras_figure(hvd, lambda keras: hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), sparse=True)
    dense = keras_figure(hvd, lambda keras: hvd.DistributedOptimizer(keras.optimizers.SGD(0.0),
                                                                     sparse_as_dense=True), sparse=True)
    assert sparse is not None and sparse == pytest.approx(dense, rel=1e-4)


def test_loss_scaling_is_undone(hvd, tf):
    plain = keras_figure(hvd, lambda keras: hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)))
    # the distributed optimizer outside the loss scaling sees gradients 2**15 times too large, then twice that
    # every 10 steps: unscaled, the steps weigh in the averages as they do without it
    scaled = keras_figure(hvd, lambda keras: hvd.DistributedOptimizer(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.0), dynamic_growth_steps=10)))
    assert plain is not None and scaled == pytest.approx(plain, rel=1e-4)


def test_ddp_through_the_communication_hook_measures_as_the_optimizer(hvd, thvd, torch_reference):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hvd_notebook.engine.frameworks import init_torch_distributed

    init_torch_distributed(thvd, "127.0.0.1")
    model = torch.nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor((W_STAR + DELTA)[None, :], dtype=torch.float32))
    ddp = DistributedDataParallel(model)
    hook = thvd.NoiseScaleHook()
    ddp.register_comm_hook(None, hook)
    x, y = batches(hvd.rank(), seed=1)
    for i in range(FEW):
        ddp.zero_grad()
        xb, yb = torch.from_numpy(x[i * BATCH:(i + 1) * BATCH]), torch.from_numpy(y[i * BATCH:(i + 1) * BATCH])
        (0.5 * ((ddp(xb) - yb) ** 2).mean()).backward()
    assert hook.noise.steps == FEW and hook.noise_scale(BATCH) == pytest.approx(torch_reference, rel=1e-3)
    assert thvd.noise_scale(BATCH) == hook.noise_scale(BATCH)
    # and DDP's averaging is its default one: the gradient is the average of the ranks'
    local = torch.from_numpy(x[(FEW - 1) * BATCH:FEW * BATCH]).T @ (
        torch.from_numpy(x[(FEW - 1) * BATCH:FEW * BATCH]) @ model.weight.detach().T
        - torch.from_numpy(y[(FEW - 1) * BATCH:FEW * BATCH])) / BATCH
    average = torch.from_numpy(np.mean(hvd.allgather_object(local.numpy()), axis=0))
    torch.testing.assert_close(model.weight.grad, average.T, rtol=1e-5, atol=1e-6)
    dist.barrier()
