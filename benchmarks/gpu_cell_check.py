"""The notebook path on one GPU, as a user takes it (benchmarks/gpu_check.sh runs this after the gpu tests):

1. a ResNet-50-sized synthetic training step in plain PyTorch, in this process (the baseline);
2. `%load_ext hvd_notebook` and `%hvd start -n 1 --framework torch` in a real IPython shell: the rank
   pinned to the GPU, NCCL's communicator bootstrapped over MPI, torch.distributed on NCCL;
3. the same step in a `%%hvd` cell with `hvd.DistributedOptimizer`, `broadcast_parameters` and a tqdm bar
   (the dashboard, in text mode here), timed on the rank.

Rounds of the two alternate (plain, cell, plain, ...; medians), as one step's time drifts by a third from
run to run on the lent machine. On one rank `DistributedOptimizer` reduces nothing (Horovod's rule) unless
`HVD_NOTEBOOK_REDUCE_ALONE=1`, which the device check sets: then the cell's step reduces its gradients as on
more ranks, and `reduce_alone` in the JSON says what the rank saw.
Target (issue 18): the cell's step at most 3 % slower than the plain one. Writes JSON to argv[1].

    python benchmarks/gpu_cell_check.py OUT.json [--quick]
    python benchmarks/gpu_cell_check.py OUT.json --cpu      # a dry run of the whole path on CPUs (32x32 images)
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import textwrap
import time

STEPS, QUICK_STEPS, WARMUP, BATCH, ROUNDS = 30, 8, 5, 64, 3

MODEL = textwrap.dedent("""
    import time, torch
    try:
        import torchvision
        make_model, model_name = (lambda: torchvision.models.resnet50(num_classes=1000)), "resnet50"
    except ImportError:  # a ResNet-50-sized stand-in: 25 M parameters of convolutions and a head
        make_model = lambda: torch.nn.Sequential(
            torch.nn.Conv2d(3, 256, 7, stride=4), torch.nn.ReLU(), torch.nn.Conv2d(256, 1024, 3, stride=2),
            torch.nn.ReLU(), torch.nn.Conv2d(1024, 2048, 3, stride=2), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(2048, 1000))
        model_name = "resnet50-sized convolutions"
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    x = torch.randn({batch}, 3, {side}, {side}, device="{device}")
    y = torch.randint(0, 1000, ({batch},), device="{device}")

    def sync():
        if x.is_cuda:
            torch.cuda.synchronize()

    def step(model, opt):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("{device}", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss
""")

PLAIN = MODEL + textwrap.dedent("""
    model = make_model().to("{device}", memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for _ in range({warmup}):
        step(model, opt)
    sync()

    def plain_round():
        t0 = time.perf_counter()
        for _ in range({steps}):
            step(model, opt)
        sync()
        return (time.perf_counter() - t0) / {steps}
""")

SETUP = "%%hvd\n" + MODEL + textwrap.dedent("""
    from tqdm.auto import tqdm
    model = make_model().to("{device}", memory_format=torch.channels_last)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range({warmup}):
        step(model, opt)
    sync()
""")

# a bar over a loader of the step count's batches (its batch_size gives the dashboard samples/s); the loss
# shown every 10 steps, as reading it forces a device sync
ROUND = "%%hvd --progress text\n" + textwrap.dedent("""
    t0 = time.perf_counter()
    bar = tqdm(torch.utils.data.DataLoader(range({steps} * {batch}), batch_size={batch}))
    for i, _ in enumerate(bar):
        loss = step(model, opt)
        if i % 10 == 0:
            bar.set_postfix(loss=float(loss.detach()))
    sync()
    import os
    print("REDUCE_ALONE", os.environ.get("HVD_NOTEBOOK_REDUCE_ALONE", "unset"))
    print("CELL_STEP_S", (time.perf_counter() - t0) / {steps}, model_name, hvd.nccl_built(),
          torch.distributed.get_backend(), torch.cuda.get_device_name(0) if x.is_cuda else "CPU")
""")


def main() -> None:
    out_path, quick, cpu = sys.argv[1], "--quick" in sys.argv, "--cpu" in sys.argv
    steps = 2 if cpu else QUICK_STEPS if quick else STEPS
    rounds = 2 if cpu or quick else ROUNDS
    fill = {"batch": 2 if cpu else BATCH, "warmup": 1 if cpu else WARMUP, "steps": steps,
            "device": "cpu" if cpu else "cuda", "side": 32 if cpu else 224}
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    plain: dict = {}
    exec(PLAIN.format(**fill), plain)  # noqa: S102 (our own code)

    shell.run_line_magic("load_ext", "hvd_notebook")
    t0 = time.monotonic()
    started = shell.run_cell("%hvd start -n 1 --framework torch" + (" --gpus none" if cpu else ""))
    start_s = time.monotonic() - t0
    from hvd_notebook.kernel.session import Session

    cluster = Session.get().cluster
    if not started.success or cluster is None:
        sys.exit("gpu_cell_check: %hvd start -n 1 --framework torch failed")
    rank = cluster.ranks[0]
    import io
    from contextlib import redirect_stdout

    plain_s, cell_s, out = [], [], ""
    try:
        if not shell.run_cell(SETUP.format(**fill)).success:
            sys.exit("gpu_cell_check: the setup cell failed")
        for _ in range(rounds):  # alternating, so that the machine's drift hits both
            plain_s.append(plain["plain_round"]())
            captured = io.StringIO()
            with redirect_stdout(captured):
                result = shell.run_cell(ROUND.format(**fill))
            out = captured.getvalue()
            print(out)
            found = re.search(r"CELL_STEP_S (\S+) (.+) (True|False) (\S+) (.+)$", out, re.M)
            if not result.success or found is None:
                sys.exit("gpu_cell_check: the %%hvd cell failed:\n" + out[-3000:])
            cell_s.append(float(found.group(1)))
    finally:
        shell.run_line_magic("hvd", "stop")
    plain_median, cell_median = statistics.median(plain_s), statistics.median(cell_s)
    report = {
        "gpu": found.group(5), "model": found.group(2), "batch": fill["batch"], "steps": steps, "rounds": rounds,
        "plain_step_s": plain_median, "cell_step_s": cell_median, "ratio": cell_median / plain_median,
        "plain_rounds_s": plain_s, "cell_rounds_s": cell_s, "target": 1.03,
        "start_s": start_s, "rank_device": rank.device, "framework": rank.framework,
        "nccl": found.group(3) == "True", "torch_distributed": found.group(4),
        "reduce_alone": (re.findall(r"REDUCE_ALONE (\S+)", out) or ["?"])[0],
        "dashboard_lines": [line for line in out.splitlines() if line.startswith("[hvd_notebook]")],
    }
    with open(out_path, "w") as f:
        json.dump(report, f, indent=2)
    rounds_text = ", ".join(f"{p * 1e3:.1f}/{c * 1e3:.1f}" for p, c in zip(plain_s, cell_s))
    print(f"gpu_cell_check: {report['model']}, batch {fill['batch']}, {rounds} rounds of {steps} steps "
          f"(plain/cell ms: {rounds_text}): plain {plain_median * 1e3:.1f} ms/step, %%hvd cell with "
          f"DistributedOptimizer and the dashboard {cell_median * 1e3:.1f} ms/step "
          f"({cell_median / plain_median:.3f}x, target <= 1.03x); start {start_s:.1f} s on {rank.device}")


if __name__ == "__main__":
    main()
