"""``hvd.DistributedOptimizer`` over the ``torch.distributed`` transport (``HVD_NOTEBOOK_TORCH_TRANSPORT=dist``,
gloo), 2 ranks, a model of 62 parameter tensors: DDP's weights after a few steps; at most one collective per
bucket, counted on the process group's own methods (which every collective goes through, from any thread); no
host wait in a step beyond the device module's; no per-tensor op in the reduction (a ``TorchDispatchMode`` in
the threads that pack and unpack); and the order mark -> enter -> issue -> wait -> unpack, seen through a
recording device module. tests/integration/test_parallel.py runs this file in the ``torch-dist`` world."""

from __future__ import annotations

import contextlib
import gc
import os
import threading

import pytest
import torch

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(os.environ.get("HVD_NOTEBOOK_TORCH_TRANSPORT") != "dist",
                                reason="runs under HVD_NOTEBOOK_TORCH_TRANSPORT=dist (the torch-dist world)")
COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_into_tensor_coalesced",
               "broadcast", "reduce_scatter", "_reduce_scatter_base", "alltoall_base", "alltoall", "reduce",
               "gather", "scatter", "barrier")
LAYERS = 31  # 62 parameter tensors


@pytest.fixture(scope="module")
def thvd(hvd):
    import hvd_notebook.runtime.torch as thvd

    thvd.init()
    assert torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"
    return thvd


@pytest.fixture
def quiet_noise(monkeypatch):
    """No noise scale (its one allreduce per step, and its host read of two norms, are not the reduction's)."""
    monkeypatch.setenv("HVD_NOTEBOOK_NOISE_SCALE", "0")


def _model(seed: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(96, 96) for _ in range(LAYERS)])


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 96, generator=torch.Generator().manual_seed(100 * step + rank))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _wrapped(thvd, model: torch.nn.Module) -> torch.optim.Optimizer:
    return thvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                     named_parameters=model.named_parameters())


def _buckets(model: torch.nn.Module) -> int:
    from hvd_notebook.runtime.torch.optimizer import gradient_buckets

    return len(gradient_buckets(list(model.parameters())))


@contextlib.contextmanager
def _counted_collectives():
    """Count the collectives issued meanwhile, by name, from any thread (the process group's own methods)."""
    group_class = torch._C._distributed_c10d.ProcessGroup
    counts: dict[str, int] = {}
    lock = threading.Lock()
    # (the class's own entries: pybind's instancemethods, bound to each group as it calls them)
    originals = {name: group_class.__dict__[name] for name in COLLECTIVES if name in group_class.__dict__}

    def counting(name, original):
        def wrapper(group, *args, **kwargs):
            with lock:
                counts[name] = counts.get(name, 0) + 1
            return original.__get__(group, type(group))(*args, **kwargs)
        return wrapper

    for name, original in originals.items():
        setattr(group_class, name, counting(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(group_class, name, original)


def test_the_process_group_methods_count_every_collective(thvd):
    with _counted_collectives() as counts:
        torch.distributed.all_reduce(torch.ones(2))
        torch.distributed.broadcast(torch.ones(2), src=0)
    assert counts == {"allreduce": 1, "broadcast": 1}, counts


def test_distributed_optimizer_gives_ddp_s_weights(thvd, quiet_noise):
    r = thvd.rank()
    ddp_model, model = _model(), _model()
    assert len(list(model.parameters())) >= 60
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    opt = _wrapped(thvd, model)
    for step in range(3):
        _step(ddp, ddp_opt, _batch(r, step))
        _step(model, opt, _batch(r, step))
    for a, b in zip(model.parameters(), ddp_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    assert len(set(thvd.allgather_object(digest))) == 1


def test_one_collective_per_bucket_at_most(thvd, quiet_noise):
    model = _model()
    opt = _wrapped(thvd, model)
    buckets = _buckets(model)
    assert buckets >= 2
    _step(model, opt, _batch(thvd.rank(), 0))  # (the buffers made once)
    for step in range(1, 4):
        with _counted_collectives() as counts:
            _step(model, opt, _batch(thvd.rank(), step))
        assert set(counts) <= {"allreduce"} and 1 <= counts.get("allreduce", 0) <= buckets, (counts, buckets)


def test_nothing_waits_on_the_host_in_a_step(thvd, quiet_noise, monkeypatch):
    from hvd_notebook.runtime.torch import device

    model = _model()
    opt = _wrapped(thvd, model)
    _step(model, opt, _batch(thvd.rank(), 0))
    waits: list[str] = []
    original_after = device.after

    def refuse(what):
        def raising(*args, **kwargs):
            raise AssertionError(f"{what} waited on the host inside a step")
        return raising

    def after(work, buffer):  # (on gloo, the wait is the data movement itself: allowed, counted)
        waits.append(threading.current_thread().name)
        return original_after(work, buffer)

    for name in ("item", "cpu", "tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
    monkeypatch.setattr(device, "after", after)
    for step in range(1, 3):
        _step(model, opt, _batch(thvd.rank(), step))
    monkeypatch.undo()
    assert 1 <= len(waits) <= 2 * _buckets(model), waits  # one wait per reduction finished, no other


def test_a_step_hashes_each_parameter_a_few_times(thvd, quiet_noise, monkeypatch):
    model = _model()
    opt = _wrapped(thvd, model)
    _step(model, opt, _batch(thvd.rank(), 0))
    hashed = [0]
    original = torch.Tensor.__hash__

    def counting(tensor):  # (a bucket hashed as a tuple of its tensors costs one per tensor per lookup)
        hashed[0] += 1
        return original(tensor)

    monkeypatch.setattr(torch.Tensor, "__hash__", counting)
    _step(model, opt, _batch(thvd.rank(), 1))
    monkeypatch.undo()
    assert hashed[0] <= 8 * LAYERS * 2, hashed  # (a few lookups per parameter, none per pair of them)


class _AtenCount(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops run meanwhile in this thread."""

    def __init__(self, into: list[str]) -> None:
        super().__init__()
        self.into = into

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.into.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_no_per_tensor_op_in_the_reduction(thvd, quiet_noise, monkeypatch):
    from hvd_notebook.runtime.torch import dist_backend

    model = _model()
    opt = _wrapped(thvd, model)
    _step(model, opt, _batch(thvd.rank(), 0))  # (the buffers and their views made once)
    seen: list[list[str]] = []
    run, finish = dist_backend._AllreduceWork.run, dist_backend.Issued.finish

    def counted(original):
        def wrapper(*args, **kwargs):  # (in the thread that packs and issues, or that unpacks)
            ops: list[str] = []
            with _AtenCount(ops):
                result = original(*args, **kwargs)
            seen.append(ops)
            return result
        return wrapper

    monkeypatch.setattr(dist_backend._AllreduceWork, "run", counted(run))
    monkeypatch.setattr(dist_backend.Issued, "finish", counted(finish))
    _step(model, opt, _batch(thvd.rank(), 1))
    monkeypatch.undo()
    per_bucket, buckets = LAYERS * 2 // _buckets(model), _buckets(model)
    assert seen and all(len(ops) <= 4 for ops in seen), seen  # a few ops per call, whatever its tensors
    # each bucket one call (issued, finished), its buffer reduced in place: the hooks copied the gradients in as
    # backward made them, and the gradients are views of the buffers (as DDP's gradient_as_bucket_view)
    assert per_bucket > 4 and len(seen) == 2 * buckets and not any("copy" in o for ops in seen for o in ops), seen
    assert len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}) == buckets


def test_the_order_mark_enter_issue_wait_unpack(thvd, quiet_noise, monkeypatch):
    from hvd_notebook.runtime.torch import device, dist_backend

    calls: list[str] = []
    lock = threading.Lock()

    def recording(what, original):
        def wrapper(*args, **kwargs):
            with lock:
                calls.append(what)
            return original(*args, **kwargs)
        return wrapper

    @contextlib.contextmanager
    def enter(marks):
        calls.append("enter")
        with original_enter(marks) as stream:
            yield stream

    original_enter = device.enter
    monkeypatch.setattr(device, "mark", recording("mark", device.mark))
    monkeypatch.setattr(device, "enter", enter)
    monkeypatch.setattr(device, "after", recording("wait", device.after))
    monkeypatch.setattr(dist_backend.dist, "all_reduce", recording("issue", dist_backend.dist.all_reduce))
    monkeypatch.setattr(dist_backend, "finish_", recording("unpack", dist_backend.finish_))
    t = torch.full((4,), float(thvd.rank() + 1))
    out = thvd.grouped_allreduce([t, t * 2], op=thvd.Sum, name="order.sync")
    assert calls == ["mark", "enter", "issue", "wait", "unpack"], calls
    calls.clear()
    handle = thvd.allreduce_async_(t, op=thvd.Sum, name="order.async")
    while "issue" not in calls:  # (issued in its worker, inside the agreed turn; finished by synchronize)
        threading.Event().wait(0.001)
    assert calls == ["mark", "enter", "issue"], calls
    assert thvd.synchronize(handle) is t and calls == ["mark", "enter", "issue", "wait", "unpack"], calls
    n = thvd.size()
    assert out[1].tolist() == [n * (n + 1)] * 4 and t.tolist() == [n * (n + 1) / 2] * 4


@pytest.mark.timeout(60, method="thread")  # (a hang ends the rank, and so the world, instead of waiting for gloo's)
def test_a_rank_that_never_used_the_transport_serves_the_others_after_join(thvd):
    """Horovod's test_horovod_join_allreduce: a rank joins before any call of its own went through
    torch.distributed; it must take part in the others' gloo allreduces there, not through the MPI library."""
    from hvd_notebook.runtime.core import world
    from hvd_notebook.runtime.torch import dist_backend

    here, n, r = world.current(), thvd.size(), thvd.rank()
    for first in range(n):
        if r == first:  # (as in a fresh process: no DistBackend made, none serving its road)
            dist_backend._backends.pop(here, None)
            here.serving.pop(dist_backend.VIA, None)
            assert thvd.join() != first
            continue
        a = thvd.allreduce_async(torch.full((5,), 4, dtype=torch.int32), name="join.a", average=True)
        b = thvd.allreduce_async(torch.full((17,), 4.0), name="join.b", average=True)
        assert thvd.synchronize(a).tolist() == [4 * (n - 1) // n] * 5
        assert thvd.synchronize(b).tolist() == [4.0 * (n - 1) / n] * 17
        assert thvd.join() != first


def test_refusals_uneven_rows_and_mixed_dtypes(thvd):
    """What the MPI library's path refuses is refused on every rank here too; uneven blocks and mixed dtypes."""
    n, r = thvd.size(), thvd.rank()
    with pytest.raises(ValueError, match="cannot be reduced"):
        thvd.allreduce(torch.ones(2, dtype=torch.bool), name="refused.bool")
    with pytest.raises(ValueError, match="needs at least one dimension"):
        thvd.allgather(torch.tensor(1.0), name="refused.scalar")
    with pytest.raises(ValueError, match="needs at least one dimension"):
        thvd.reducescatter(torch.tensor(1.0), name="refused.scalar.rs")
    with pytest.raises(ValueError, match="splits"):
        thvd.alltoall(torch.ones(2 * n), splits=[n + 5] + [0] * (n - 1), name="refused.splits")
    rows = thvd.reducescatter(torch.arange(3.0).reshape(3, 1) * (r + 1), op=thvd.Sum, name="uneven")
    assert rows.tolist() == ([[0.0], [n * (n + 1) / 2]] if r == 0 else [[n * (n + 1)]])
    mixed = thvd.grouped_allreduce([torch.ones(2), torch.ones(3, dtype=torch.int32), torch.ones(1)], op=thvd.Sum)
    assert [t.dtype for t in mixed] == [torch.float32, torch.int32, torch.float32]
    assert [t.tolist() for t in mixed] == [[n] * 2, [n] * 3, [n]]


def test_a_process_set_has_its_own_group_made_once(thvd, monkeypatch):
    from hvd_notebook.runtime.torch import group

    thvd.init(process_sets="dynamic")
    made: list[list[int]] = []
    new_group = torch.distributed.new_group
    monkeypatch.setattr(torch.distributed, "new_group",
                        lambda ranks, **kw: made.append(ranks) or new_group(ranks, **kw))
    alone = thvd.add_process_set([1])
    if thvd.rank() == 1:
        for _ in range(2):
            assert thvd.allreduce(torch.ones(2), op=thvd.Sum, process_set=alone, name="alone").tolist() == [1.0] * 2
        assert made == [[1]] and len(group._groups) >= 1
    assert thvd.remove_process_set(alone)
    gc.collect()
    assert not group._groups  # (its group freed with the set)
    assert thvd.allreduce(torch.ones(1), op=thvd.Sum).tolist() == [float(thvd.size())]


def test_a_bad_transport_names_the_two_choices(thvd, monkeypatch):
    monkeypatch.setenv("HVD_NOTEBOOK_TORCH_TRANSPORT", "nccl")
    with pytest.raises(ValueError, match="HVD_NOTEBOOK_TORCH_TRANSPORT='nccl': use mpi .* or dist"):
        thvd.allreduce(torch.ones(1), name="bad.transport")


def test_the_default_group_must_span_hvd_s_world(thvd, monkeypatch):
    import types

    from hvd_notebook.runtime.core import world
    from hvd_notebook.runtime.torch import group

    here = world.current()
    assert group.spans(here)
    assert not group.spans(types.SimpleNamespace(rank=here.rank, size=here.size + 1))
    monkeypatch.setattr(group, "spans", lambda world: False)  # (as where hvd.init(comm=...) took some ranks only)
    with pytest.raises(RuntimeError, match="needs torch.distributed's default group over hvd's world"):
        thvd.allreduce(torch.ones(1), name="not.spanned")
