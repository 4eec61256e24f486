"""``hvd-notebook scaling`` measuring for real on this machine's CPUs: one and two ranks launched by
``hvd-notebook run``, hvd.DistributedOptimizer beside DDP, the report and its JSON (the projection's
arithmetic: unit/test_scaling_model.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import left_running

BIN = Path(sys.executable).parent
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "HVD_NOTEBOOK_GPUS": ""}


def test_scaling_measures_one_and_two_ranks_and_projects(tmp_path):
    out = tmp_path / "scaling.json"
    proc = subprocess.run([str(BIN / "hvd-notebook"), "scaling", "-n", "2", "--steps", "4", "--rounds", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    one, two = figures["points"]
    assert (one["ranks"], two["ranks"]) == (1, 2) and one["model"] == "mlp" and one["device"] == "cpu"
    for point in (one, two):
        assert 0 < point["forward_s"] < point["compute_s"] and point["hvd_step_s"] > 0 and point["ddp_step_s"] > 0
        assert sum(point["bucket_bytes"]) == point["gradient_bytes"] == 4 * point["parameters"]
    assert [p["ranks"] for p in figures["projected"]] == [8, 64, 256]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line[:1].isdigit()}
    assert {"1", "2", "8", "64", "256"} <= set(rows), proc.stdout
    assert rows["2"][2] == f"{2 * two['batch'] / two['hvd_step_s']:.1f}", proc.stdout  # images/s over both ranks
    assert not left_running("hvd_notebook.engine.scaling_worker")


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None,
                    reason="torchvision is installed here: resnet50 would run (make install leaves it out)")
def test_a_model_that_needs_torchvision_says_so_before_launching():
    proc = subprocess.run([str(BIN / "hvd-notebook"), "scaling", "--model", "resnet50"], capture_output=True,
                          text=True, timeout=60, env=ENV)
    assert proc.returncode == 2 and "needs torchvision (pip install torchvision)" in proc.stderr, proc.stderr
    assert "rank(s) ..." not in proc.stderr  # nothing was launched


REDUCES = """
import json, os, sys, torch
import hvd_notebook.runtime.torch as hvd
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.Linear(300, 300), torch.nn.Linear(300, 2))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
hvd.start_timeline(sys.argv[1])
model(torch.ones(4, 8)).sum().backward()
opt.step()
hvd.stop_timeline()
events = json.load(open(sys.argv[1]))["traceEvents"]
print("CALLS", json.dumps([e["args"]["tensors"] for e in events if e["name"] == "MPI_ALLREDUCE"]))
"""


@pytest.mark.parametrize("alone", ["1", "0"])
def test_one_rank_reduces_its_buckets_only_when_asked_for_measuring(tmp_path, alone):
    """``HVD_NOTEBOOK_REDUCE_ALONE=1``: the reduction that more ranks make, on one (what the device check
    measures against DDP on one GPU); by default one rank reduces nothing, as Horovod's."""
    from hvd_notebook.cluster.launching.placements import find_mpiexec

    proc = subprocess.run([find_mpiexec(None), "-n", "1", sys.executable, "-c", REDUCES, str(tmp_path / "t.json")],
                          capture_output=True, text=True, timeout=120,
                          env={**ENV, "HVD_NOTEBOOK_REDUCE_ALONE": alone, "CUDA_VISIBLE_DEVICES": "-1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    calls = json.loads(proc.stdout.split("CALLS", 1)[1])
    if alone == "1":  # two buckets (the last layers within 1 MiB, then the rest), each one grouped call
        assert len(calls) in (1, 2) and all(c.startswith(("2.bias.0 ", "1.weight.0 ")) for c in calls), calls
    else:
        assert calls == []
