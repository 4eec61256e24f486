"""Runs inside `mpiexec -n 2` for bench_torch.py: the PyTorch binding against raw MPI, against raw
`dist.all_reduce`, against DistributedDataParallel, and its overlap of communication with backward; rank 0
writes JSON, with the transport the binding's data really took (`dist` where `hvd.allreduce` issued a
`torch.distributed` collective, else `mpi`).

    mpiexec -n 2 python benchmarks/mpi_torch_worker.py OUT.json [--quick]

The rows compared across transports (raw dist.all_reduce, the 62-tensor step against DDP) run twice in the
one world: over the default transport, then with HVD_NOTEBOOK_TORCH_TRANSPORT=dist set on every rank (the
binding routes each call as the variable says when it is made) under "over_dist".
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import torch_collectives_during  # noqa: E402
from mpi4py import MPI  # noqa: E402
from mpi_timing import median_pair  # noqa: E402

import hvd_notebook.runtime.torch as hvd  # noqa: E402
from hvd_notebook.engine.frameworks import init_torch_distributed  # noqa: E402

torch.set_num_threads(1)


def allreduce_sizes(comm, quick: bool) -> dict:
    out = {}
    for nbytes in (4 << 10, 1 << 20, 16 << 20):
        t = torch.ones(nbytes // 4)
        send, recv = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
        reps = (20 if quick else 200) if nbytes <= 1 << 20 else (5 if quick else 30)
        ours, raw = median_pair(lambda t=t: hvd.allreduce(t, op=hvd.Sum, name="bench"),
                                lambda s=send, r=recv: comm.Allreduce(s, r, op=MPI.SUM), reps, comm)
        out[str(nbytes)] = {"hvd_s": ours, "raw_mpi_s": raw}
    return out


def transport() -> str:
    """``dist`` where an ``hvd.allreduce`` of a CPU tensor issues a torch.distributed collective, else ``mpi``."""
    issued = torch_collectives_during(lambda: hvd.allreduce(torch.ones(4), op=hvd.Sum, name="transport.probe"))
    return "dist" if issued else "mpi"


def raw_dist(comm, quick: bool) -> dict:
    """hvd.allreduce against a raw ``dist.all_reduce`` (gloo) of a tensor of the same size, 4 KiB and 1 MiB."""
    out = {}
    for nbytes in (4 << 10, 1 << 20):
        ours, theirs = torch.ones(nbytes // 4), torch.ones(nbytes // 4)
        hvd_s, raw_s = median_pair(lambda t=ours: hvd.allreduce(t, op=hvd.Sum, name="bench.raw_dist"),
                                   lambda t=theirs: dist.all_reduce(t), 20 if quick else 200, comm)
        out[str(nbytes)] = {"hvd_s": hvd_s, "raw_dist_s": raw_s}
    return out


def transport_rows(comm, quick: bool) -> dict:
    """The rows compared across transports, with the transport the binding's data really took."""
    return {"transport": transport(), "raw_dist": raw_dist(comm, quick),
            "ddp_many_small": optimizer_vs_ddp(comm, quick, many_small, width=860, batch=32)}


def mlp(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def many_small(width: int = 860, blocks: int = 15) -> torch.nn.Module:
    """ResNet-18's shape of gradients without torchvision: 62 tensors, 11.1 M parameters, half of the tensors
    tiny (each block a Linear and a LayerNorm, as a ResNet block's convolutions and batch norms)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def optimizer_vs_ddp(comm, quick: bool, build=lambda: mlp(512, 6), width: int = 512, batch: int = 64) -> dict:
    """The same model, data and SGD step: hvd.DistributedOptimizer against DDP (gloo)."""
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
    model_h = build()
    opt_h = hvd.DistributedOptimizer(torch.optim.SGD(model_h.parameters(), lr=0.01),
                                     named_parameters=model_h.named_parameters())
    model_d = torch.nn.parallel.DistributedDataParallel(build())
    opt_d = torch.optim.SGD(model_d.parameters(), lr=0.01)

    def step(model, opt):
        def run():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return run

    ours, ddp = median_pair(step(model_h, opt_h), step(model_d, opt_d), 10 if quick else 60, comm)
    params = sum(p.numel() for p in model_h.parameters())
    return {"hvd_step_s": ours, "ddp_step_s": ddp, "parameters": params, "tensors": len(list(model_h.parameters()))}


class _SlowBackward(torch.autograd.Function):
    """Identity forward; a fixed delay in backward (a layer's compute, without using a core)."""

    @staticmethod
    def forward(ctx, x, delay):
        ctx.delay = delay
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.delay)
        return grad, None


class Delayed(torch.nn.Module):
    def __init__(self, width: int, delay: float) -> None:
        super().__init__()
        self.linear, self.delay = torch.nn.Linear(width, width), delay

    def forward(self, x):
        return _SlowBackward.apply(self.linear(x), self.delay)


def overlap(comm, quick: bool) -> dict:
    """Backward with a delay per layer (compute that leaves the CPU free, as a GPU's does), each layer's
    gradient large: the backward pass alone, the gradients' reduction alone (one grouped call after
    backward), and backward under DistributedOptimizer until every gradient is reduced, whose
    reductions start from the hooks while backward goes on. (The optimizer's own update, the same
    with or without hvd, is left out; gradients are zeroed in place, not reallocated.)"""
    width, depth, delay = 1448, 8, 0.015  # 8 x 8 MiB of gradients; 8 x 15 ms of backward
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Delayed(width, delay) for _ in range(depth)])
    x = torch.randn(4, width)
    plain = torch.optim.SGD(model.parameters(), lr=1e-6)

    def compute():
        plain.zero_grad(set_to_none=False)
        model(x).sum().backward()

    grads = [torch.randn_like(p) for p in model.parameters()]

    def communicate():
        hvd.grouped_allreduce(grads, name="overlap.grads")

    reps = 5 if quick else 20
    compute_s, comm_s = median_pair(compute, communicate, reps, comm)
    wrapped = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-6),
                                       named_parameters=model.named_parameters())

    def step():
        wrapped.zero_grad(set_to_none=False)
        model(x).sum().backward()
        wrapped.synchronize()

    step_s, _ = median_pair(step, lambda: None, reps, comm)
    return {"compute_s": compute_s, "communication_s": comm_s, "step_s": step_s,
            "gradient_mib": sum(p.numel() for p in model.parameters()) * 4 / 2**20}


def main() -> None:
    out_path, quick = sys.argv[1], "--quick" in sys.argv
    hvd.init()
    comm = MPI.COMM_WORLD
    init_torch_distributed(hvd, "127.0.0.1")  # gloo, as a --framework torch cluster's ranks have it
    result = {"sizes": allreduce_sizes(comm, quick), "ddp": optimizer_vs_ddp(comm, quick),
              "overlap": overlap(comm, quick), "torch": torch.__version__, **transport_rows(comm, quick)}
    comm.Barrier()
    os.environ["HVD_NOTEBOOK_TORCH_TRANSPORT"] = "dist"
    try:
        result["over_dist"] = transport_rows(comm, quick)
    except Exception as exc:  # the dist transport broken: said in its rows, the others kept
        result["over_dist"] = {"transport": "failed", "error": f"{type(exc).__name__}: {exc}"[:300]}
    if hvd.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
