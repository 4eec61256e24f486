"""Runs inside `mpiexec -n 1` for the device check (gpu_check.sh) and `benchmarks/run.py gpu`: one rank, the
reduction forced (HVD_NOTEBOOK_REDUCE_ALONE=1), the rows issue 51 asks of a lent GPU. On CPUs (`--cpu`) the
same code runs tiny, on gloo, as the check's rehearsal; the rows that need CUDA say so and why.

    CUDA_VISIBLE_DEVICES=0 HVD_NOTEBOOK_REDUCE_ALONE=1 mpiexec -n 1 python benchmarks/mpi_gpu_worker.py OUT.json
    mpiexec -n 1 python benchmarks/mpi_gpu_worker.py OUT.json --cpu [--quick]

Rows, each written to OUT.json as soon as it is measured (a step killed at its time limit keeps what is done):
`hvd.allreduce` of 1 MiB against raw `dist.all_reduce` and raw cupy NCCL; ResNet-50's 161 gradients in one
`grouped_allreduce` against one raw call on their bytes; the host overhead of a step (a queued ~0.2 s
`torch.cuda._sleep`, then backward and `step()`, which must return before the GPU ends, with the right values
after a synchronize); a step under `torch.cuda.set_sync_debug_mode("error")`; a whole ResNet-50 step under
`hvd.DistributedOptimizer` against the same step under DDP, alternating rounds.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common import torch_collectives_during

import hvd_notebook.runtime.torch as hvd
from hvd_notebook.engine.frameworks import init_torch_distributed

MIB = 1 << 20
NO_GPU = "no GPU (the CPU rehearsal)"
SLEEP_S = 0.2


class Bench:
    """Where the rows run (cuda or cpu), how big and how often, and the JSON that grows row by row."""

    def __init__(self, out_path: str, cuda: bool, quick: bool) -> None:
        self.out_path, self.cuda, self.quick = out_path, cuda, quick
        self.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        self.result: dict[str, Any] = {"device": "cuda" if cuda else "cpu", "rows": {}, "errors": {}}

    def reps(self, full: int, quick: int, cpu: int = 2) -> int:
        return cpu if not self.cuda else quick if self.quick else full

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def save(self) -> None:
        tmp = self.out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.result, f, indent=2)
        os.replace(tmp, self.out_path)

    def row(self, name: str, measure: Callable[[], dict[str, Any]]) -> None:
        """Measure one row and save at once; an error is recorded for that row and the next ones still run."""
        print(f"[gpu worker] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            self.result["rows"][name] = {**measure(), "seconds": round(time.perf_counter() - t0, 2)}
        except Exception as exc:  # one broken row must not cost the others the device window
            traceback.print_exc()
            self.result["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
        self.save()


def timed(fn: Callable[[], Any], bench: Bench) -> float:
    bench.sync()
    t0 = time.perf_counter()
    fn()
    bench.sync()
    return time.perf_counter() - t0


def interleaved(calls: dict[str, Callable[[], Any]], bench: Bench, warmups: int, reps: int) -> dict[str, float]:
    """Median seconds of each call, timed in turn between device syncs, so that drift hits them all."""
    for _ in range(warmups):
        for fn in calls.values():
            fn()
    samples: dict[str, list[float]] = {key: [] for key in calls}
    for _ in range(reps):
        for key, fn in calls.items():
            samples[key].append(timed(fn, bench))
    return {key: statistics.median(values) for key, values in samples.items()}


# ----------------------------------------------------------------------------------------------- raw baselines
def raw_cupy(nelems: int) -> tuple[Callable[[], None], Callable[[], None]] | None:
    """cupy's raw out-of-place NCCL allreduce of ``nelems`` float32s, waited for, and its clean-up; None
    without cupy (the reason goes into the row)."""
    import cupy as cp
    from cupy.cuda import nccl

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    stream = cp.cuda.Stream(non_blocking=True)
    send, recv = cp.ones(nelems, dtype=cp.float32), cp.empty(nelems, dtype=cp.float32)

    def call() -> None:
        comm.allReduce(send.data.ptr, recv.data.ptr, nelems, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
        stream.synchronize()

    return call, comm.destroy


def hvd_cupy(shapes: list[tuple[int, ...]]) -> Callable[[], None]:
    """hvd's NCCL backend (``array_backend`` on cupy and NCCL: the path of TensorFlow's GPU tensors, which
    cannot reach this machine) reducing float32 cupy arrays of ``shapes`` in one call, waited for."""
    import cupy as cp

    from hvd_notebook.runtime.core import ops, world

    backend = world.current().nccl
    if backend is None:
        raise RuntimeError("the world has no NCCL backend (cupy sees no GPU, or HVD_NOTEBOOK_NCCL=0)")
    arrays = [cp.ones(shape, dtype=cp.float32) for shape in shapes]
    names = [f"bench.cupy.{i}" for i in range(len(arrays))]

    def call() -> None:
        backend.allreduce(arrays, ops.Sum, 1.0, 1.0, names)
        cp.cuda.get_current_stream().synchronize()

    return call


def with_cupy(calls: dict[str, Callable[[], Any]], bench: Bench, nelems: int, warmups: int,
              reps: int, shapes: list[tuple[int, ...]] | None = None) -> dict[str, Any]:
    """``calls`` timed with raw cupy NCCL beside them where cupy is there, and hvd's NCCL backend on cupy
    arrays of ``shapes`` (default one of ``nelems``); each absence said in the row."""
    if not bench.cuda:
        return {**interleaved(calls, bench, warmups, reps), "raw_cupy_skipped": NO_GPU, "hvd_cupy_skipped": NO_GPU}
    try:
        call, destroy = raw_cupy(nelems)
    except Exception as exc:  # no cupy, or its NCCL missing: the torch rows still count
        why = f"no cupy NCCL: {exc}"[:300]
        return {**interleaved(calls, bench, warmups, reps), "raw_cupy_skipped": why, "hvd_cupy_skipped": why}
    extra: dict[str, Any] = {"raw_cupy_s": call}
    skipped = {}
    try:
        extra["hvd_cupy_s"] = hvd_cupy(shapes or [(nelems,)])
    except Exception as exc:  # the raw row still counts
        skipped["hvd_cupy_skipped"] = f"hvd's NCCL backend: {type(exc).__name__}: {exc}"[:300]
    try:
        return {**interleaved({**calls, **extra}, bench, warmups, reps), **skipped}
    finally:
        destroy()


# ------------------------------------------------------------------------------------------- the rows
def allreduce_1mib(bench: Bench) -> dict[str, Any]:
    """hvd.allreduce of 1 MiB (float32) against a raw ``dist.all_reduce`` on another tensor of that size."""
    ours, theirs = (torch.ones(MIB // 4, device=bench.device) for _ in range(2))
    calls = {"hvd_s": lambda: hvd.allreduce(ours, op=hvd.Sum, name="bench.1mib"),
             "raw_dist_s": lambda: dist.all_reduce(theirs)}
    reps = bench.reps(200, 30, 5)
    return {"nbytes": MIB, "reps": reps, **with_cupy(calls, bench, MIB // 4, 5, reps)}


def resnet50_shapes() -> tuple[list[tuple[int, ...]], str]:
    """ResNet-50's 161 parameter shapes: torchvision's where it is installed, else built by its rule (a 7x7
    stem, bottlenecks of 3, 4, 6, 3 blocks at widths 64 .. 512 times 4, batch norms, a 1000-way head)."""
    try:
        import torchvision
    except ImportError:
        pass
    else:
        return [tuple(p.shape) for p in torchvision.models.resnet50().parameters()], "torchvision"
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inp = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            shapes += [(width, inp, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,),
                       (4 * width, width, 1, 1), (4 * width,), (4 * width,)]
            if block == 0:
                shapes += [(4 * width, inp, 1, 1), (4 * width,), (4 * width,)]
            inp = 4 * width
    return shapes + [(1000, 2048), (1000,)], "built by ResNet-50's rule (no torchvision)"


def gradients(bench: Bench) -> dict[str, Any]:
    """ResNet-50's 161 gradients in one grouped_allreduce (Average) against one raw all_reduce of their bytes."""
    shapes, source = resnet50_shapes()
    grads = [torch.ones(shape, device=bench.device) for shape in shapes]
    nelems = sum(g.numel() for g in grads)
    flat = torch.ones(nelems, device=bench.device)
    calls = {"grouped_s": lambda: hvd.grouped_allreduce(grads, op=hvd.Average, name="bench.grads"),
             "raw_dist_s": lambda: dist.all_reduce(flat)}
    reps = bench.reps(20, 5, 2)
    return {"tensors": len(grads), "nbytes": 4 * nelems, "shapes_from": source, "reps": reps,
            **with_cupy(calls, bench, nelems, 2, reps, shapes)}


def make_model(bench: Bench) -> tuple[torch.nn.Module, str]:
    """ResNet-50 from torchvision on a GPU; a stand-in elsewhere (a ResNet-50-sized one on a GPU without
    torchvision; a tiny one of 84 tensors for the CPU rehearsal)."""
    torch.manual_seed(0)
    if not bench.cuda:
        blocks = [m for _ in range(20) for m in (torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                                  torch.nn.ReLU())]
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), *blocks, torch.nn.AdaptiveAvgPool2d(1),
                                   torch.nn.Flatten(), torch.nn.Linear(8, 1000)), "tiny convolutions (CPU)"
    try:
        import torchvision
        return torchvision.models.resnet50(num_classes=1000), "resnet50"
    except ImportError:
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 256, 7, stride=4), torch.nn.ReLU(), torch.nn.Conv2d(256, 1024, 3, stride=2),
            torch.nn.ReLU(), torch.nn.Conv2d(1024, 2048, 3, stride=2), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(2048, 1000)), "resnet50-sized"


def batch(bench: Bench, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    n, side = (size, 224) if bench.cuda else (2, 16)
    return torch.randn(n, 3, side, side, device=bench.device), torch.randint(0, 1000, (n,), device=bench.device)


def on_device(model: torch.nn.Module, bench: Bench) -> torch.nn.Module:
    return model.to(bench.device, memory_format=torch.channels_last) if bench.cuda else model


def wrapped(model: torch.nn.Module, lr: float = 0.01, momentum: float = 0.9) -> torch.optim.Optimizer:
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                                    named_parameters=model.named_parameters())


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        return torch.nn.functional.cross_entropy(model(x), y)


def stepper(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
            autocast: bool) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_of(model, x, y, autocast).backward()
        opt.step()
    return step


def step_vs_ddp(bench: Bench) -> dict[str, Any]:
    """A whole training step (bf16 autocast on a GPU, batch 64, SGD with momentum) under DistributedOptimizer,
    under DDP, and plain (the compute alone), in alternating rounds of steps; medians of the rounds."""
    base, name = make_model(bench)
    x, y = batch(bench)
    hvd_model, ddp_model, plain_model = (on_device(copy.deepcopy(base), bench) for _ in range(3))
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model, device_ids=[0] if bench.cuda else None)
    steps = {"hvd_step_s": stepper(hvd_model, wrapped(hvd_model), x, y, bench.cuda),
             "ddp_step_s": stepper(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9), x, y, bench.cuda),
             "compute_s": stepper(plain_model, torch.optim.SGD(plain_model.parameters(), lr=0.01, momentum=0.9),
                                  x, y, bench.cuda)}
    per_round, rounds = bench.reps(20, 5, 2), bench.reps(5, 2, 2)
    for step in steps.values():
        for _ in range(3):
            step()
    samples: dict[str, list[float]] = {key: [] for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            samples[key].append(timed(lambda s=step: [s() for _ in range(per_round)], bench) / per_round)
    return {"model": name, "batch": x.shape[0], "tensors": len(list(base.parameters())), "rounds": rounds,
            "steps_per_round": per_round, "rounds_s": samples,
            **{key: statistics.median(values) for key, values in samples.items()}}


def sleep_cycles(seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for ``seconds``, measured with events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds * 1e3 / start.elapsed_time(end))


def values_right(model: torch.nn.Module, before: list[torch.Tensor], reference: torch.nn.Module, x: torch.Tensor,
                 y: torch.Tensor, lr: float) -> dict[str, Any]:
    """After a synchronize: each parameter moved by -lr times its gradient, and that gradient is the one a plain
    backward of the same model gives (one rank: the average is the gradient itself)."""
    loss_of(reference, x, y, False).backward()
    params, refs = list(model.parameters()), list(reference.parameters())
    update = max(float((b - lr * p.grad - p.detach()).abs().max()) for p, b in zip(params, before))
    grad = max(float((p.grad - r.grad).abs().max() / (r.grad.abs().max() + 1e-12)) for p, r in zip(params, refs))
    # (the gradient's tolerance leaves room for cuDNN's nondeterministic sums; a missed or stale reduction is O(1))
    return {"max_update_error": update, "max_gradient_rel_error": grad, "right": update < 1e-5 and grad < 1e-2}


def host_overhead(bench: Bench) -> dict[str, Any]:
    """Queue ~0.2 s of GPU sleep after the forward pass, then backward and step(): the host times of
    backward and of step() returning, against the GPU's end; then the values, after a synchronize."""
    base, name = make_model(bench)
    base = on_device(base, bench)
    x, y = batch(bench, 32)
    lr, model = 0.01, base
    opt = wrapped(model, lr=lr, momentum=0.0)
    for _ in range(3):
        stepper(model, opt, x, y, False)()
    bench.sync()
    reference = on_device(make_model(bench)[0], bench)  # not a deepcopy: that would copy the optimizer's hooks
    reference.load_state_dict(model.state_dict())
    before = [p.detach().clone() for p in model.parameters()]
    cycles = sleep_cycles(SLEEP_S) if bench.cuda else 0
    bench.sync()
    opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = loss_of(model, x, y, False)
    if bench.cuda:
        torch.cuda._sleep(cycles)
    loss.backward()
    t_backward = time.perf_counter()
    opt.step()
    t_step = time.perf_counter()
    bench.sync()
    t_end = time.perf_counter()
    checked = values_right(model, before, reference, x, y, lr)
    out = {"model": name, "sleep_s": SLEEP_S if bench.cuda else 0.0, "host_backward_s": t_backward - t0,
           "host_step_call_s": t_step - t_backward, "host_back_s": t_step - t0, "gpu_end_s": t_end - t0,
           "values": checked}
    out["host_ahead"] = bench.cuda and out["gpu_end_s"] - out["host_back_s"] > SLEEP_S / 2
    if not bench.cuda:
        out["host_ahead_skipped"] = NO_GPU + ": nothing to queue, the values are checked alone"
    return out


def sync_debug(bench: Bench) -> dict[str, Any]:
    """A plain step and a DistributedOptimizer step under set_sync_debug_mode("error"): any host sync raises."""
    if not bench.cuda:
        return {"skipped": NO_GPU + ": set_sync_debug_mode needs CUDA"}
    base, _ = make_model(bench)
    x, y = batch(bench, 16)
    out = {}
    for key, model in (("plain", on_device(copy.deepcopy(base), bench)), ("hvd", on_device(base, bench))):
        opt = wrapped(model) if key == "hvd" else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        step = stepper(model, opt, x, y, True)
        step()  # set-up (buckets, buffers) outside the mode: the steady step is what must not sync
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            out[key] = "no host sync"
        except RuntimeError as exc:
            out[key] = f"synced: {exc}"[:1000]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    out["passed"] = out["hvd"] == "no host sync"
    return out


def environment(bench: Bench) -> dict[str, Any]:
    """Versions and settings, and whether hvd's data really takes torch.distributed (it must, on a GPU)."""
    probe = torch.ones(4, device=bench.device)
    issued = torch_collectives_during(lambda: hvd.allreduce(probe, op=hvd.Sum, name="bench.probe"))
    info = {"torch": torch.__version__, "backend": dist.get_backend(), "world_size": dist.get_world_size(),
            "hvd_through_torch_distributed": issued > 0,
            "reduce_alone": os.environ.get("HVD_NOTEBOOK_REDUCE_ALONE"),
            "torch_transport": os.environ.get("HVD_NOTEBOOK_TORCH_TRANSPORT", "(default)")}
    if bench.cuda:
        version = torch.cuda.nccl.version()
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    nccl=".".join(map(str, version)) if isinstance(version, tuple) else str(version))
    return info


def main() -> None:
    out_path, quick, cpu = sys.argv[1], "--quick" in sys.argv, "--cpu" in sys.argv
    if not cpu and not torch.cuda.is_available():
        sys.exit("mpi_gpu_worker: no GPU visible to PyTorch (a CPU build, or CUDA_VISIBLE_DEVICES empty?); "
                 "--cpu runs the rehearsal")
    if not cpu:
        torch.cuda.set_device(0)
    torch.set_num_threads(1 if cpu else torch.get_num_threads())
    bench = Bench(out_path, cuda=not cpu, quick=quick)
    hvd.init()
    init_torch_distributed(hvd, "127.0.0.1")
    bench.row("environment", lambda: environment(bench))
    bench.result["environment"] = bench.result["rows"].pop("environment", None)
    for name, measure in (("allreduce_1mib", allreduce_1mib), ("gradients", gradients),
                          ("host_overhead", host_overhead), ("sync_debug", sync_debug), ("step", step_vs_ddp)):
        bench.row(name, lambda m=measure: m(bench))
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
