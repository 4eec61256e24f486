"""PyTorch CUDA tensors through torch.distributed's NCCL group, and cupy arrays through the framework-neutral
NCCL core, under mpiexec, one GPU per rank.

Every test here is a `gpu` test: without NCCL on every rank it skips, saying why (or fails, under
HVD_PARALLEL_REQUIRE_NCCL=1, as benchmarks/gpu_check.sh runs it). Checked: every collective on CUDA
tensors through NCCL with the right values, dtypes and device; no trip through the host (the host
conversion is never called, the timeline shows NCCL phases and no MPI data phase, in-place results
stay in the tensor's memory); stream ordering (a result reflects a kernel that wrote the input just
before on the caller's stream, held back by a sleep kernel); cupy arrays through hvd_notebook.runtime;
DistributedOptimizer on a CUDA model (its reduction forced on one rank too).

    HVD_PARALLEL=1 HVD_PARALLEL_MIN_RANKS=1 HVD_PARALLEL_REQUIRE_NCCL=1 CUDA_VISIBLE_DEVICES=0 \\
        mpiexec -n 1 python -m pytest -m gpu tests/parallel/test_torch_gpu.py
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (the [torch] extra)")

gpu = pytest.mark.gpu
OPS = ("Sum", "Average", "Min", "Max", "Product")


@pytest.fixture(scope="module")
def thvd(hvd):
    """horovod.torch's API where every rank has NCCL; elsewhere a skip with the reason (a failure under
    HVD_PARALLEL_REQUIRE_NCCL=1: a check that skips everything proves nothing)."""
    import hvd_notebook.runtime.torch as thvd
    from hvd_notebook.runtime.torch import group

    thvd.init()  # (torch.distributed's default group: NCCL where a GPU is)
    if not (torch.cuda.is_available() and group.has_nccl(None)):
        why = ("needs one NVIDIA GPU per rank and PyTorch's CUDA build; benchmarks/gpu_check.sh runs these "
               "tests on the lent GPU machine")
        if os.environ.get("HVD_PARALLEL_REQUIRE_NCCL") == "1":
            pytest.fail(f"NCCL is not enabled: {why}")
        pytest.skip(why)
    torch.cuda.set_device(0)
    return thvd


@pytest.fixture
def no_host_trips(monkeypatch):
    """Fail if anything is converted through the host (the binding's only way there)."""
    from hvd_notebook.runtime.torch import functions, mpi_ops, tensors

    def refuse(*args, **kwargs):
        raise AssertionError("a CUDA tensor went through the host")

    for module in (tensors, mpi_ops, functions):
        monkeypatch.setattr(module, "host_array", refuse)


def _value(shape, rank, dtype):
    return ((torch.arange(int(np.prod(shape)), dtype=torch.float64) % 4 + rank + 1).reshape(shape)).to(dtype).cuda()


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
                                   torch.int64, torch.uint8])
@pytest.mark.parametrize("op", OPS)
def test_allreduce_of_cuda_tensors_every_op_and_dtype(thvd, no_host_trips, op, dtype):
    n, r = thvd.size(), thvd.rank()
    if dtype == torch.uint8 and op == "Product" and n > 2:
        pytest.skip("uint8 products of more than 2 ranks overflow")
    for shape in ((), (7,), (3, 5)):
        out = thvd.allreduce(_value(shape, r, dtype), op=getattr(thvd, op), name=f"gpu.{op}.{dtype}.{shape}")
        assert out.is_cuda and out.dtype == dtype and out.shape == torch.Size(shape)
        stacked = torch.stack([_value(shape, k, torch.float64).cpu() for k in range(n)])
        expected = {"Sum": stacked.sum(0), "Average": stacked.mean(0), "Min": stacked.min(0).values,
                    "Max": stacked.max(0).values, "Product": stacked.prod(0)}[op]
        if not dtype.is_floating_point and op == "Average":
            expected = torch.trunc(expected)
        torch.testing.assert_close(out.cpu().double(), expected.to(dtype).double(), rtol=1e-2, atol=1e-2)


@gpu
def test_the_other_collectives_and_forms_on_cuda(thvd, no_host_trips):
    n, r = thvd.size(), thvd.rank()
    t = torch.full((5,), float(r + 1), device="cuda")
    pointer = t.data_ptr()
    assert thvd.allreduce_(t, op=thvd.Sum) is t and t.data_ptr() == pointer and t.is_cuda
    assert t.cpu().tolist() == [n * (n + 1) / 2] * 5
    handles = [thvd.allreduce_async(torch.full((3,), float(i), device="cuda"), name=f"gpu.async.{i}", op=thvd.Sum)
               for i in range(4)]
    assert [thvd.synchronize(h).cpu()[0].item() for h in handles] == [i * n for i in range(4)]
    group = thvd.grouped_allreduce([torch.ones(3, device="cuda"), torch.ones(2, 2, device="cuda", dtype=torch.half)],
                                   op=thvd.Sum)
    assert group[0].is_cuda and group[1].dtype == torch.half and group[1].cpu().tolist() == [[n, n], [n, n]]
    g = thvd.allgather(torch.full((r + 1, 2), float(r), device="cuda", dtype=torch.bfloat16))
    assert g.is_cuda and g.dtype == torch.bfloat16 and g.shape == (n * (n + 1) // 2, 2)
    b = thvd.broadcast(torch.arange(4, device="cuda") + r, root_rank=0)
    assert b.is_cuda and b.cpu().tolist() == [0, 1, 2, 3]
    rs = thvd.reducescatter(torch.ones(2 * n, 3, device="cuda"), op=thvd.Sum)
    assert rs.is_cuda and rs.shape == (2, 3) and bool((rs == n).all())


@gpu
def test_a_result_reflects_the_kernel_that_wrote_its_input_just_before(thvd, no_host_trips):
    """Stream ordering: the input is written by a kernel queued behind a long sleep kernel on the caller's
    stream; NCCL's stream must wait for it, on the default stream and on a side stream alike."""
    n = thvd.size()
    for side in (False, True):
        stream = torch.cuda.Stream() if side else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            x = torch.zeros(1 << 22, device="cuda")
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the fill
            x.fill_(1.0)
            out = thvd.allreduce(x, op=thvd.Sum, name=f"ordering.{side}")
            torch.cuda._sleep(50_000_000)
            handle = thvd.allreduce_async(x * 2, op=thvd.Sum, name=f"ordering.async.{side}")
        out_async = thvd.synchronize(handle)
        torch.cuda.synchronize()
        assert float(out.min()) == float(out.max()) == n, side
        assert float(out_async.min()) == float(out_async.max()) == 2 * n, side


@gpu
def test_nccl_phases_and_no_mpi_data_phase_in_the_timeline(thvd, no_host_trips, tmp_path):
    path = thvd.broadcast_object(str(tmp_path / "trace.json"), root_rank=0)
    thvd.start_timeline(path)
    thvd.allreduce(torch.ones(1 << 20, device="cuda"), name="timeline.gpu")
    thvd.allgather(torch.ones(4, 4, device="cuda"), name="timeline.gather")
    thvd.stop_timeline()
    if thvd.rank() == 0:
        names = {e["name"] for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"}
        assert {"NCCL_ALLREDUCE", "NCCL_ALLGATHER"} <= names and "MPI_ALLREDUCE" not in names, names


@gpu
def test_cupy_arrays_through_hvd_notebook_runtime(hvd, thvd):
    if not hvd.nccl_enabled():
        pytest.skip("cupy's NCCL is not enabled on every rank (cupy is for TensorFlow and cupy arrays only)")
    import cupy as cp

    n, r = hvd.size(), hvd.rank()
    out = hvd.allreduce(cp.full(6, r + 1, dtype=cp.float32), op=hvd.Sum)
    assert isinstance(out, cp.ndarray) and float(out.min()) == n * (n + 1) / 2
    g = hvd.allgather(cp.full((r + 1, 2), r, dtype=cp.int32))
    assert isinstance(g, cp.ndarray) and g.shape == (n * (n + 1) // 2, 2)
    b = hvd.broadcast(cp.arange(3) + r, root_rank=0)
    assert cp.asnumpy(b).tolist() == [0, 1, 2]
    rs = hvd.reducescatter(cp.ones((n, 2), dtype=cp.float32), op=hvd.Sum)
    assert isinstance(rs, cp.ndarray) and rs.shape == (1, 2) and float(rs.min()) == n
    half = hvd.allreduce(cp.ones(4, dtype=cp.float32), op=hvd.Sum, compression=hvd.Compression.fp16)
    assert half.dtype == cp.float32 and float(half.min()) == n


@gpu
def test_distributed_optimizer_on_a_cuda_model(thvd, no_host_trips, monkeypatch):
    monkeypatch.setenv("HVD_NOTEBOOK_REDUCE_ALONE", "1")  # (one rank reduces too: the hooks' path runs)
    torch.manual_seed(thvd.rank())  # different weights on every rank until the broadcast (through NCCL)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).cuda()
    opt = thvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                    named_parameters=model.named_parameters())
    thvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(5):
        x = torch.randn(16, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    digest = float(sum(p.double().sum() for p in model.parameters()))
    assert len(set(thvd.allgather_object(digest))) == 1


def test_without_nccl_nothing_of_cuda_is_touched(hvd):
    """(Runs everywhere.) A world without NCCL sends CUDA tensors through the host, and the binding
    imports nothing of cupy."""
    import sys

    import hvd_notebook.runtime.torch as thvd
    from hvd_notebook.runtime.torch import group

    thvd.init()
    if group.has_nccl(None):
        pytest.skip("this world has NCCL: the CPU-only behaviour is checked where there is none")
    assert thvd.allreduce(torch.ones(2), op=thvd.Sum).tolist() == [hvd.size()] * 2
    assert "cupy" not in sys.modules
