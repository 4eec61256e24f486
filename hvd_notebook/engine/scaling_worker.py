"""One point of ``hvd-notebook scaling``, run on every rank by ``hvd-notebook run``: a PyTorch model trained on
synthetic data, its step timed under ``hvd.DistributedOptimizer`` and under DDP (blocks of steps alternating,
each after a barrier), and on one rank its compute alone (forward; forward, backward and the update), which
the projection to more GPUs starts from. Rank 0 writes the figures as JSON.

    python -m hvd_notebook.engine.scaling_worker OUT.json MODEL BATCH STEPS ROUNDS THREADS

On CPU ranks every rank gets THREADS threads (the command gives each point the same, the node's cores over
its most ranks), so that one rank and N ranks differ by their communication, not by their share of cores.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

MODELS = ("mlp", "resnet18", "resnet50")


def build(name: str) -> tuple[Any, tuple[int, ...], int]:
    """The model, the shape of one sample and the number of classes.

    Args:
        name: the model's name in the benchmark's table.
    """
    import torch

    torch.manual_seed(0)
    if name == "mlp":  # (a CPU-sized stand-in: 13 tensors, 1.6 M parameters)
        layers: list[Any] = []
        for _ in range(6):
            layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(512, 10)), (512,), 10
    try:
        import torchvision
    except ImportError:
        raise SystemExit(f"hvd-notebook scaling --model {name} needs torchvision (pip install torchvision), "
                         "or take --model mlp") from None
    return getattr(torchvision.models, name)(num_classes=1000), (3, 224, 224), 1000


def timed_steps(step: Any, steps: int, sync: Any) -> float:
    """The median of ``steps`` timed calls of ``step`` (``sync`` waits for the device after each).

    Args:
        step: one training step, called with no arguments.
        steps: how many steps are timed.
        sync: waits for the device's work to finish (a no-op on CPU).
    """
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    """One rank of the scaling benchmark: time the model's training steps and write what was measured.

    Args:
        argv: the result's file, the model's name, then the batch, steps, rounds and threads.
    """
    out, model_name, (batch, steps, rounds, threads) = argv[0], argv[1], map(int, argv[2:6])
    import torch
    import torch.distributed as dist

    import hvd_notebook.runtime.torch as hvd

    from .frameworks import init_torch_distributed

    hvd.init()
    gpu = torch.cuda.is_available()
    # (a rank pinned to its GPU sees that one alone; one that sees them all takes its local rank's)
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count()) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    if not gpu:
        torch.set_num_threads(threads)
    init_torch_distributed(hvd, "127.0.0.1")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    model, shape, classes = build(model_name)
    plain, wrapped, replica = model.to(device), build(model_name)[0].to(device), build(model_name)[0].to(device)
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(0, classes, (batch,), device=device)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step_of(net: Any, opt: Any) -> Any:
        def step() -> None:
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()
        return step

    local = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    ddp = torch.nn.parallel.DistributedDataParallel(replica, device_ids=[device.index] if gpu else None)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    hvd_opt = hvd.DistributedOptimizer(torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9),
                                       named_parameters=wrapped.named_parameters())
    hvd.broadcast_parameters(wrapped.state_dict(), root_rank=0)

    def forward() -> None:
        with torch.no_grad():
            plain(x)

    warm = max(2, steps // 4)
    for step in (forward, step_of(plain, local), step_of(wrapped, hvd_opt), step_of(ddp, ddp_opt)):
        timed_steps(step, warm, sync)  # (cuDNN's choice of algorithms, the allocator, the buckets' first pass)
    figures: dict[str, list[float]] = {"forward_s": [], "compute_s": [], "hvd_step_s": [], "ddp_step_s": []}
    for _ in range(rounds):
        figures["forward_s"].append(timed_steps(forward, steps, sync))
        figures["compute_s"].append(timed_steps(step_of(plain, local), steps, sync))  # (no reduction at all)
        for key, step in (("hvd_step_s", step_of(wrapped, hvd_opt)), ("ddp_step_s", step_of(ddp, ddp_opt))):
            hvd.barrier()
            figures[key].append(timed_steps(step, steps, sync))
    mine = {k: statistics.median(v) for k, v in figures.items()}
    every = hvd.allgather_object(mine)
    if hvd.rank() == 0:
        from ..runtime.torch.optimizer import gradient_buckets

        params = [p for p in wrapped.parameters() if p.requires_grad]
        result = {
            "ranks": hvd.size(), "model": model_name, "batch": batch, "device": torch.cuda.get_device_name(device)
            if gpu else "cpu", "parameters": sum(p.numel() for p in params),
            "gradient_bytes": sum(p.numel() * p.element_size() for p in params),
            "bucket_bytes": [sum(p.numel() * p.element_size() for p in b) for b in gradient_buckets(params)],
            # the slowest rank sets the pace of a synchronous step; compute is each rank's own
            **{k: max(r[k] for r in every) for k in ("hvd_step_s", "ddp_step_s")},
            **{k: statistics.median(r[k] for r in every) for k in ("forward_s", "compute_s")},
            "torch": torch.__version__,
        }
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
