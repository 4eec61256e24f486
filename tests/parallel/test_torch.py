"""``horovod.torch``'s API (hvd_notebook.runtime.torch) on PyTorch CPU tensors, in a 2-rank world: the
collectives matrix (ops x dtypes x ranks of tensor), async handles, autograd, errors instead of hangs,
fusion and the timeline, the parameter and optimizer-state broadcasts, DistributedOptimizer and
SyncBatchNorm against single-process PyTorch on the whole batch."""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

OPS = ("Sum", "Average", "Min", "Max", "Product")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8)
SHAPES = ((), (5,), (3, 4), (2, 3, 2))
ALLREDUCE_PHASES = ("MPI_ALLREDUCE", "GLOO_ALLREDUCE")  # (the MPI library, or torch.distributed: the transport)


@pytest.fixture(scope="module")
def thvd(hvd):
    import hvd_notebook.runtime.torch as thvd

    thvd.init()
    return thvd


def _expected(op: str, values: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack([v.double() for v in values])
    return {"Sum": stacked.sum(0), "Average": stacked.mean(0), "Min": stacked.min(0).values,
            "Max": stacked.max(0).values, "Product": stacked.prod(0)}[op]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_allreduce_every_op_dtype_and_rank(thvd, op, dtype, shape):
    n, r = thvd.size(), thvd.rank()

    def value(rank: int) -> torch.Tensor:
        return (torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) % 3 + rank + 1).to(dtype)

    out = thvd.allreduce(value(r), op=getattr(thvd, op), name=f"m.{op}.{dtype}.{shape}")
    assert out.dtype == dtype and out.shape == torch.Size(shape)
    expected = _expected(op, [value(k) for k in range(n)])
    if not dtype.is_floating_point and op == "Average":
        expected = torch.trunc(expected)  # Horovod 0.28's integer average truncates
    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), rtol=tol, atol=tol)


def test_in_place_and_async_forms(thvd):
    n, r = thvd.size(), thvd.rank()
    t = torch.full((4,), float(r + 1))
    assert thvd.allreduce_(t, op=thvd.Sum) is t
    torch.testing.assert_close(t, torch.full((4,), n * (n + 1) / 2))
    handles = [thvd.allreduce_async(torch.full((3,), float(i + r)), name=f"async.{i}", op=thvd.Sum) for i in range(5)]
    for i, h in enumerate(handles):
        out = thvd.synchronize(h)
        torch.testing.assert_close(out, torch.full((3,), float(n * i + n * (n - 1) / 2)))
        assert thvd.synchronize(h) is None  # a handle is taken once
    h = thvd.allreduce_async_(t2 := torch.ones(2), op=thvd.Sum)
    while not thvd.poll(h):
        time.sleep(0.001)
    assert thvd.synchronize(h) is t2 and t2.tolist() == [n, n]
    group = [torch.ones(3), torch.full((2, 2), 2.0)]
    out = thvd.grouped_allreduce_(group, op=thvd.Sum)
    assert out[0] is group[0] and group[1].tolist() == [[2.0 * n] * 2] * 2
    b = torch.full((2,), float(r))
    assert thvd.broadcast_(b, root_rank=1) is b and b.tolist() == [1.0, 1.0]
    h = thvd.broadcast_async(torch.full((2,), float(r) + 5), root_rank=0)
    assert thvd.synchronize(h).tolist() == [5.0, 5.0]


def test_allgather_broadcast_alltoall_reducescatter(thvd):
    n, r = thvd.size(), thvd.rank()
    g = thvd.allgather(torch.full((r + 1, 2), float(r)))
    assert g.shape == (n * (n + 1) // 2, 2)
    assert g[:, 0].tolist() == [float(k) for k in range(n) for _ in range(k + 1)]
    gg = thvd.grouped_allgather([torch.ones(1, dtype=torch.int64) * r, torch.ones(2, 3, dtype=torch.bfloat16)])
    assert gg[0].tolist() == list(range(n)) and gg[1].shape == (2 * n, 3) and gg[1].dtype == torch.bfloat16
    assert thvd.broadcast(torch.arange(3) + r, root_rank=1).tolist() == [1, 2, 3]
    assert thvd.broadcast(torch.tensor([r], dtype=torch.bfloat16), root_rank=0).item() == 0
    # alltoall: rank r sends rank k (k + 1) rows of value r
    splits = torch.tensor([k + 1 for k in range(n)], dtype=torch.int32)
    data = torch.full((int(splits.sum()), 2), float(r))
    out, received = thvd.alltoall(data, splits=splits)
    assert received.tolist() == [r + 1] * n
    assert out[:, 0].tolist() == [float(k) for k in range(n) for _ in range(r + 1)]
    assert thvd.alltoall(torch.arange(2 * n) + 10 * r).tolist() == [2 * r + 10 * k + j for k in range(n)
                                                                   for j in range(2)]
    rs = thvd.reducescatter(torch.arange(2.0 * n).reshape(n, 2) * (r + 1), op=thvd.Sum)
    torch.testing.assert_close(rs, torch.arange(2.0 * n).reshape(n, 2)[r:r + 1] * (n * (n + 1) / 2))
    grs = thvd.grouped_reducescatter([torch.ones(n, 1), torch.ones(n)], op=thvd.Average, postscale_factor=3.0)
    assert grs[0].tolist() == [[3.0]] and grs[1].tolist() == [3.0]
    assert thvd.broadcast_object({"from": r}, root_rank=1) == {"from": 1}
    assert thvd.allgather_object(r * 10) == [k * 10 for k in range(n)]
    thvd.barrier()


def test_sparse_allreduce_and_scaled_integer_reducescatter(thvd):
    n, r = thvd.size(), thvd.rank()
    sparse = torch.sparse_coo_tensor([[r, 2]], [1.0, 2.0], (4,), check_invariants=True)
    dense = thvd.sparse_allreduce_async(sparse, "sparse", thvd.Sum)().to_dense()  # (a function, as Horovod's)
    expected = torch.zeros(4)
    for k in range(n):
        expected[k] += 1.0
    expected[2] += 2.0 * n
    assert dense.tolist() == expected.tolist()
    # integers scaled as Horovod does, in float64 and truncated before the sum
    out = thvd.reducescatter(torch.full((n, 1), 3, dtype=torch.int32), op=thvd.Sum, prescale_factor=0.5)
    assert out.dtype == torch.int32 and out.tolist() == [[n * 1]]


def test_gradients_flow_through_the_collectives(thvd):
    n, r = thvd.size(), thvd.rank()
    x = torch.full((3,), float(r + 1), requires_grad=True)
    thvd.allreduce(x, op=thvd.Sum).sum().backward()
    assert x.grad.tolist() == [float(n)] * 3  # the gradient's own Sum allreduce of ones
    y = torch.ones(r + 1, 2, requires_grad=True)
    (thvd.allgather(y) * 2).sum().backward()
    assert y.grad.shape == y.shape and torch.all(y.grad == 2.0)
    z = torch.ones(2, requires_grad=True)
    thvd.broadcast(z, root_rank=0).sum().backward()
    assert z.grad.tolist() == ([1.0, 1.0] if r == 0 else [0.0, 0.0])
    w = torch.ones(n, 2, requires_grad=True)
    thvd.reducescatter(w, op=thvd.Sum).sum().backward()
    assert torch.all(w.grad == float(n))


def test_errors_instead_of_hangs(thvd):
    n, r = thvd.size(), thvd.rank()
    with pytest.raises(RuntimeError, match="does not match across ranks") as raised:  # every rank, none waits
        thvd.allreduce(torch.ones(2 + r), name="mismatched")
    assert isinstance(raised.value, thvd.MismatchError)  # (the core's error, a RuntimeError as Horovod's)
    with pytest.raises(TypeError, match="takes torch.Tensor, not ndarray"):
        thvd.allreduce(np.ones(2))
    with pytest.raises(TypeError, match="takes torch.Tensor, not ndarray"):
        thvd.grouped_allreduce([torch.ones(2), np.ones(2)])
    with pytest.raises(NotImplementedError, match="Adasum"):
        thvd.allreduce(torch.ones(2), op=thvd.Adasum)
    with pytest.raises(ValueError, match="root_rank"):
        thvd.broadcast(torch.ones(2), root_rank=n + 3)
    h = thvd.allreduce_async(torch.ones(3 + r), name="async.mismatched")
    with pytest.raises(ValueError):
        thvd.synchronize(h)
    with pytest.raises(ValueError, match="not a handle"):
        thvd.poll(12345678)
    if r == 0:  # (rank 1 starts its own only after the barrier: rank 0's first is surely still in flight)
        first = thvd.allreduce_async(torch.ones(2), name="twice")
        with pytest.raises(ValueError, match="'twice' is already in flight"):  # refused at once, on this rank
            thvd.allreduce_async(torch.ones(2), name="twice")
        with pytest.raises(ValueError, match="'twice' is already in flight"):  # the synchronous forms alike
            thvd.allreduce(torch.ones(2), name="twice")
    thvd.barrier()
    if r != 0:
        first = thvd.allreduce_async(torch.ones(2), name="twice")
    thvd.synchronize(first)
    thvd.synchronize(thvd.allreduce_async(torch.ones(2), name="twice"))  # free again once it finished
    torch.testing.assert_close(thvd.allreduce(torch.ones(2), op=thvd.Sum), torch.full((2,), float(n)))  # still agreed


def test_join_serves_the_other_ranks(thvd):
    r = thvd.rank()
    if r == 0:
        out = thvd.allreduce(torch.ones(3), op=thvd.Sum, name="joined")
        assert out.tolist() == [1.0] * 3  # the joined rank contributed zeros
    last = thvd.join()
    assert last == 0


@pytest.mark.parametrize("collective", ["allgather", "broadcast"])
def test_join_returns_the_last_rank_after_a_refused_collective(thvd, collective):
    # Horovod's test_horovod_join_allgather/_broadcast: each rank in turn joins first; the others' call against
    # it raises, then they join; join() returns one of them (the first to join never), alike on every rank
    r, n = thvd.rank(), thvd.size()
    for first in range(n):
        if r != first:
            root = min(k for k in range(n) if k != first)
            with pytest.raises(RuntimeError, match="After hvd.join"):
                if collective == "allgather":
                    thvd.allgather(torch.ones(3))
                else:
                    thvd.broadcast(torch.ones(3), root_rank=root, name=f"after.join.{first}")
        last = thvd.join()
        assert last != first
        assert thvd.allgather_object(last) == [last] * n


def test_join_returns_the_rank_that_joined_last_in_time(thvd):
    # no collective between the joins: the last to arrive is the one that joined last, not the highest rank
    r, n = thvd.rank(), thvd.size()
    for late in range(n):
        if r == late:
            time.sleep(0.5)  # (work without collectives)
        assert thvd.join() == late


def _one_fusion_attempt(thvd, path: str, attempt: int) -> list[str]:  # (attempt: a suffix for the names)
    """A 64 MiB "gate" allreduce, then six small calls, each from its own worker thread; rank 0's labels of
    the MPI calls that moved the six."""
    thvd.start_timeline(path)
    thvd.barrier()
    gate = thvd.allreduce_async(torch.ones(16 << 20), name=f"gate{attempt}", op=thvd.Sum)
    handles = [thvd.allreduce_async(torch.full((20000,), float(i)), name=f"layer{i}.{attempt}", op=thvd.Sum)
               for i in range(6)]
    assert thvd.synchronize(gate)[0].item() == thvd.size()
    for i, h in enumerate(handles):
        assert thvd.synchronize(h)[0].item() == i * thvd.size()
    thvd.stop_timeline()
    thvd.barrier()
    calls = []
    if thvd.rank() == 0:
        events = json.loads(open(path).read())["traceEvents"]
        calls = [e["args"]["tensors"] for e in events if e.get("pid") == 0 and e["name"] in ALLREDUCE_PHASES]
    return [c for c in thvd.broadcast_object(calls, root_rank=0) if not c.startswith("gate")]


def test_async_calls_from_worker_threads_are_agreed_and_recorded(thvd, tmp_path_factory):
    # six calls queued behind a 64 MiB gate, each from its own worker thread: every one completes with its
    # value, and the timeline accounts for each (alone or fused: a round that finds several waiting on
    # every rank fuses them, as tests/parallel/test_coordination.py proves for the core)
    path = thvd.broadcast_object(str(tmp_path_factory.mktemp("torch-fusion") / "trace.json"), root_rank=0)
    layers = _one_fusion_attempt(thvd, path, 0)
    moved = sum(1 + (int(c.split(" +")[1].split()[0]) if " +" in c else 0) for c in layers)
    assert moved == 6, layers


def test_nameless_async_calls_pair_by_their_automatic_names(thvd):
    """Horovod's test_horovod_reducescatter_async_fused: nameless asynchronous calls of different shapes, issued
    back to back; their worker threads reach the agreement in any order, so each must pair by its automatic
    name, never by arrival (a lone call per rank, of another shape on each, once failed as a mismatch)."""
    rank, size = thvd.rank(), thvd.size()
    for _ in range(3):
        tensors = [torch.arange(float((size * 4) ** dim)).reshape([size * 4] * dim) for dim in (1, 2, 3) * 4]
        handles = [thvd.reducescatter_async(t, op=thvd.Sum) for t in tensors]
        for t, h in zip(tensors, handles):
            assert torch.equal(thvd.synchronize(h), t[rank * 4:(rank + 1) * 4] * size)


def test_broadcast_parameters_and_optimizer_state(thvd):
    r = thvd.rank()
    torch.manual_seed(r)  # different initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if r == 0:  # only rank 0 has stepped: the others have no optimizer state at all
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.param_groups[0]["lr"] = 0.05
    thvd.broadcast_parameters(model.state_dict(), root_rank=0)
    thvd.broadcast_optimizer_state(opt, root_rank=0)
    params = [p.detach().numpy().copy() for p in model.state_dict().values()]
    state = [v.numpy().copy() for s in opt.state_dict()["state"].values() for v in s.values()]
    every = thvd.allgather_object((params, state, opt.param_groups[0]["lr"]))
    for other in every[1:]:
        for a, b in zip(every[0][0] + every[0][1], other[0] + other[1]):
            np.testing.assert_array_equal(a, b)
        assert other[2] == 0.05
    assert len(every[0][1]) == 3 * len(list(model.parameters()))  # step, exp_avg, exp_avg_sq of each
    thvd.broadcast_parameters(list(model.named_parameters()), root_rank=1)
    with pytest.raises(ValueError, match="dict .*or a list of"):
        thvd.broadcast_parameters([1, 2], root_rank=0)


def _data(seed: int, rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)


def _model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


@pytest.mark.parametrize("options", [{}, {"backward_passes_per_step": 2}, {"gradient_predivide_factor": 2.0},
                                     {"groups": 2}, {"compression": "fp16"}])
def test_distributed_optimizer_equals_one_process_on_the_whole_batch(thvd, options):
    n, r = thvd.size(), thvd.rank()
    options = dict(options)
    if options.get("compression") == "fp16":
        options["compression"] = thvd.Compression.fp16
    passes = options.get("backward_passes_per_step", 1)
    reference, model = _model(), _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = thvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters(), **options)
    assert isinstance(opt, torch.optim.SGD)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(4):
        ref_opt.zero_grad()
        opt.zero_grad()
        for micro in range(passes):
            x, y = _data(100 * step + micro, rows=8 * n)
            (loss_fn(reference(x), y) / passes).backward()  # the whole batch in one process
            mine = slice(8 * r, 8 * (r + 1))
            (loss_fn(model(x[mine]), y[mine]) / passes).backward()  # this rank's share
        ref_opt.step()
        opt.step()
    tol = 2e-3 if "compression" in options else 1e-5
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    weights = thvd.allgather_object([p.detach().numpy() for p in model.parameters()])
    for a, b in zip(weights[0], weights[-1]):
        np.testing.assert_array_equal(a, b)  # identical on every rank, bit for bit


def test_distributed_optimizer_guards(thvd):
    model = _model()
    opt = thvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters())
    x, y = _data(1, rows=4)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    with pytest.raises(ValueError, match="duplicates"):
        thvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=[("w", p) for p in model.parameters()])
    with pytest.raises(ValueError, match="not in it"):
        thvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=list(model.named_parameters())[:1])
    with pytest.raises(NotImplementedError, match="Adasum"):
        thvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=thvd.Adasum)


def test_a_cell_run_again_wraps_the_same_parameters_once(thvd):
    # a notebook re-runs the cell that makes the optimizer: the newest one owns the parameters, each
    # gradient is reduced once (with two hooks a Sum would double, and the second call's name collide)
    model = _model()
    thvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                              op=thvd.Sum)
    opt = thvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), op=thvd.Sum)
    x, y = _data(5, rows=4)
    reference = _model()  # (the hooks reduce model's gradients in place while backward runs)
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad * thvd.size())  # the same data on every rank: summed once


def test_a_layer_frozen_after_the_optimizer_was_made_stays_as_it_is(thvd):
    # fine-tuning: requires_grad turned off after DistributedOptimizer shared the layer's bucket with
    # others; weight decay would move it if the reduction gave it a zero gradient
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = thvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, weight_decay=0.1),
                                    named_parameters=model.named_parameters())
    model[0].requires_grad_(False)
    frozen = [p.detach().clone() for p in model[0].parameters()]
    model(torch.ones(2, 3) * (thvd.rank() + 1)).sum().backward()
    opt.step()
    for p, before in zip(model[0].parameters(), frozen):
        assert p.grad is None and torch.equal(p, before)
    weights = thvd.allgather_object([p.detach().numpy() for p in model[1].parameters()])
    for w0, w1 in zip(weights[0], weights[-1]):
        np.testing.assert_array_equal(w0, w1)


def test_a_parameter_without_gradient_on_one_rank(thvd):
    # rank 1 never uses the second layer: its zeros still meet rank 0's gradient
    torch.manual_seed(3)
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    params = [*a.named_parameters(prefix="a"), *b.named_parameters(prefix="b")]
    opt = thvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=1.0), named_parameters=params)
    x = torch.ones(1, 2)
    out = b(a(x)) if thvd.rank() == 0 else a(x)
    out.sum().backward()
    opt.step()
    weights = thvd.allgather_object([p.detach().numpy() for _, p in params])
    for w0, w1 in zip(weights[0], weights[-1]):
        np.testing.assert_array_equal(w0, w1)


def _wide(sparse: bool) -> torch.nn.Module:
    """Nine tensors, the largest 1.6 MB: two buckets in backward's order (the last three tensors within the
    first bucket's 1 MiB; the other six, the embedding's sparse gradient among them, within 25 MiB)."""
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.EmbeddingBag(50, 8, mode="sum", sparse=sparse), torch.nn.Linear(8, 640),
                               torch.nn.LayerNorm(640), torch.nn.Linear(640, 640), torch.nn.Linear(640, 3))


@pytest.mark.parametrize("sparse", [False, True])
def test_gradients_travel_in_buckets_in_backward_order(thvd, tmp_path_factory, sparse):
    from hvd_notebook.runtime.torch.optimizer import gradient_buckets

    n, r = thvd.size(), thvd.rank()
    reference, model = _wide(sparse), _wide(sparse)
    params = list(model.parameters())
    buckets = gradient_buckets(params)
    assert [len(b) for b in buckets] == [3, 6] and buckets[0][0] is params[-1], [len(b) for b in buckets]
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = thvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), named_parameters=model.named_parameters())
    path = thvd.broadcast_object(str(tmp_path_factory.mktemp("buckets") / "trace.json"), root_rank=0)
    g = torch.Generator().manual_seed(9)
    x, y = torch.randint(0, 50, (4 * n, 3), generator=g), torch.randint(0, 3, (4 * n,), generator=g)
    thvd.start_timeline(path)
    for model_, opt_, rows in ((reference, ref_opt, slice(None)), (model, opt, slice(4 * r, 4 * (r + 1)))):
        opt_.zero_grad()
        torch.nn.functional.cross_entropy(model_(x[rows]), y[rows]).backward()
        opt_.step()
    thvd.stop_timeline()
    thvd.barrier()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    calls = []
    if r == 0:
        events = json.loads(open(path).read())["traceEvents"]
        calls = [e["args"]["tensors"] for e in events if e.get("pid") == 0 and e["name"] in ALLREDUCE_PHASES
                 and not e["args"]["tensors"].startswith("noise_scale")]
    calls = thvd.broadcast_object(calls, root_rank=0)
    names = {q: name for name, q in model.named_parameters()}
    heads = [names[b[0]] for b in buckets]  # a call's label: "<its first name>.0 +k ..." (a flat bucket: the name)
    # each bucket in one call (two where they shared one), never a tensor alone
    assert 1 <= len(calls) <= 2 and all(any(c == h or c.startswith(f"{h}.0 ") for h in heads) for c in calls), \
        (calls, heads)


def test_sync_batch_norm_equals_batch_norm_on_the_whole_batch(thvd):
    n, r = thvd.size(), thvd.rank()
    x = torch.randn(4 * n, 3, 5, generator=torch.Generator().manual_seed(11))
    mine = x[4 * r:4 * (r + 1)].clone().requires_grad_(True)
    whole = x.clone().requires_grad_(True)
    sync, plain = thvd.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    (sync(mine) ** 2).sum().backward()
    (plain(whole) ** 2).sum().backward()
    torch.testing.assert_close(mine.grad, whole.grad[4 * r:4 * (r + 1)], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sync.running_mean, plain.running_mean)
    torch.testing.assert_close(sync.running_var, plain.running_var)
    torch.testing.assert_close(thvd.allreduce(sync.weight.grad, op=thvd.Sum), plain.weight.grad, rtol=1e-4, atol=1e-5)


def test_tensorflow_is_never_imported(thvd):
    assert "tensorflow" not in sys.modules
