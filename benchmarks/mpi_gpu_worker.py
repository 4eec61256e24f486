"""Runs inside `mpiexec -n 1` for bench_gpu.py, on one GPU, with PyTorch and cupy (no TensorFlow: the lent
GPU machine has none): hvd.allreduce of a CUDA tensor (hvd_notebook.runtime.torch, through the NCCL core)
against a raw NCCL allreduce through cupy on the same memory, 1 MiB .. 256 MiB. Writes JSON.

    CUDA_VISIBLE_DEVICES=0 mpiexec -n 1 python benchmarks/mpi_gpu_worker.py OUT.json [--quick]

Correctness is not checked here: that is `pytest -m gpu` (tests/parallel/test_torch_gpu.py).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import cupy as cp
import torch
from cupy.cuda import nccl

import hvd_notebook.runtime.torch as hvd
from hvd_notebook.runtime.torch.gpu import as_cupy

MIB = 1 << 20
# buffer size -> timed repetitions (each after 3 untimed warm-ups)
SIZES = {MIB: 50, 4 * MIB: 50, 16 * MIB: 30, 64 * MIB: 20, 256 * MIB: 10}
QUICK_SIZES = {MIB: 10, 16 * MIB: 5}


def timed(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def interleaved(calls: dict[str, Callable[[], Any]], warmups: int, reps: int) -> dict[str, float]:
    """Median seconds of each call, the calls timed in turn (after ``warmups`` untimed rounds), so that the
    machine's drift hits them all."""
    for _ in range(warmups):
        for fn in calls.values():
            timed(fn)
    samples: dict[str, list[float]] = {key: [] for key in calls}
    for _ in range(reps):
        for key, fn in calls.items():
            samples[key].append(timed(fn))
    return {key: statistics.median(values) for key, values in samples.items()}


def raw_allreduce(comm: Any, stream: Any, send: Any) -> Callable[[], None]:
    """cupy's raw out-of-place NCCL allreduce of the float32 array ``send``, waited for."""
    recv = cp.empty(send.size, dtype=cp.float32)

    def call() -> None:
        comm.allReduce(send.data.ptr, recv.data.ptr, send.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
        stream.synchronize()

    return call


def one_size(comm: Any, stream: Any, nbytes: int, reps: int) -> dict[str, Any]:
    """Median seconds of hvd's allreduce (out of place, into a new tensor) and of the raw out-of-place NCCL
    call on the same tensor's memory."""
    t = torch.ones(nbytes // 4, device="cuda")

    def ours() -> None:
        hvd.allreduce(t, op=hvd.Sum, name="bench")

    return {"reps": reps, **interleaved({"hvd_s": ours, "raw_nccl_s": raw_allreduce(comm, stream, as_cupy(t))},
                                        3, reps)}


def gradient_shapes() -> list[tuple[int, ...]]:
    """ResNet-50's parameter shapes (torchvision's; a stand-in list of its sizes where that is missing)."""
    try:
        import torchvision
    except ImportError:
        return [(256, 256, 3, 3)] * 40 + [(2048,)] * 120 + [(1000, 2048)]  # 161 tensors, 25.9 M
    return [tuple(p.shape) for p in torchvision.models.resnet50().parameters()]


def gradients(comm: Any, stream: Any, reps: int) -> dict[str, Any]:
    """A step's gradient reduction, ResNet-50's 161 tensors (float32): one grouped call, and one
    ``allreduce_async`` per tensor then a ``synchronize`` of each (DistributedOptimizer's way at more
    than one rank), against one raw NCCL allreduce of all their bytes in one buffer."""
    grads = [torch.ones(shape, device="cuda") for shape in gradient_shapes()]
    n = sum(g.numel() for g in grads)

    def grouped() -> None:
        hvd.grouped_allreduce(grads, op=hvd.Average, name="grads")

    def per_tensor() -> None:
        handles = [hvd.allreduce_async(g, op=hvd.Average, name=f"grad.{i}") for i, g in enumerate(grads)]
        for h in handles:
            hvd.synchronize(h)

    raw = raw_allreduce(comm, stream, cp.ones(n, dtype=cp.float32))
    result: dict[str, Any] = interleaved({"grouped_s": grouped, "per_tensor_s": per_tensor, "raw_nccl_s": raw},
                                         2, reps)
    result.update(tensors=len(grads), nbytes=4 * n, reps=reps)
    return result


def main() -> None:
    out_path, quick = sys.argv[1], "--quick" in sys.argv
    if not torch.cuda.is_available():
        sys.exit("no GPU visible to PyTorch (a CPU build, or CUDA_VISIBLE_DEVICES empty?)")
    torch.cuda.set_device(0)
    hvd.init()
    if hvd.size() != 1 or not hvd.nccl_built() or hvd_world_nccl() is None:
        sys.exit(f"run as one rank with NCCL (size {hvd.size()}, NCCL: {hvd_world_nccl() is not None})")
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    stream = cp.cuda.Stream(non_blocking=True)
    sizes: dict[str, Any] = {}
    try:
        for nbytes, reps in (QUICK_SIZES if quick else SIZES).items():
            sizes[str(nbytes)] = one_size(comm, stream, nbytes, reps)
            torch.cuda.empty_cache()
        grads = gradients(comm, stream, 3 if quick else 10)
    finally:
        comm.destroy()
    code = nccl.get_version()
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cupy": cp.__version__,
              "nccl": f"{code // 10000}.{code % 10000 // 100}.{code % 100}", "sizes": sizes, "gradients": grads}
    hvd.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)


def hvd_world_nccl() -> Any:
    from hvd_notebook.runtime.core import world
    return world.current().nccl


if __name__ == "__main__":
    main()
