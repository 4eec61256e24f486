"""Training resumed after a suspend ends as training that never stopped: 2 CPU ranks, Keras 3, Keras 2 (tf_keras),
a ``horovod.torch`` loop and a DDP loop, N steps + save + a new world's restore + M steps against N + M steps
(``suspension_world.py`` runs the cells in each rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hvd_notebook.cluster.launching.placements import find_mpiexec

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FRAMEWORKS = {"k3": "Keras 3", "k2": "Keras 2", "net": "horovod.torch", "ddp_net": "DDP"}


def _world(name: str, folder: Path) -> None:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60"}
    cmd = [find_mpiexec(None), "-n", "2", sys.executable, str(HERE / "suspension_world.py"), name, str(folder)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"world {name}: " + proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    folder = tmp_path_factory.mktemp("suspension")
    _world("first", folder)  # the straight run, and the one that suspends
    _world("second", folder)  # a new mpiexec: the resumes
    load = {phase: [dict(np.load(folder / f"{phase}-rank{r}.npz")) for r in (0, 1)]
            for phase in ("straight", "suspend", "resume", "resume-no-rng")}
    reports = {world: [json.loads((folder / f"reports-{world}-rank{r}.json").read_text()) for r in (0, 1)]
               for world in ("first", "second")}
    return load, reports


def _differences(a: dict, b: dict) -> dict[str, float]:
    assert sorted(a) == sorted(b)
    return {k: float(np.max(np.abs(a[k] - b[k]))) if a[k].size else 0.0 for k in a}


def test_resumed_training_ends_as_training_that_never_stopped(worlds):
    load, _ = worlds
    for rank in (0, 1):
        straight, resumed = load["straight"][rank], load["resume"][rank]
        assert int(resumed["step"]) == int(straight["step"]) == 6
        for framework in FRAMEWORKS:  # weights and optimizer state (iterations, momentum, Adam's moments)
            assert any(k.startswith(framework) for k in straight)
        off = {k: d for k, d in _differences(straight, resumed).items() if d > 1e-6}
        assert off == {}, f"rank {rank}: the resumed run differs from the straight one in {off}"
    # the reduced models are alike on both ranks (the replayed DistributedOptimizer and DDP reduce again)
    assert {k: d for k, d in _differences(*load["resume"]).items() if d > 1e-6 and k.split(".")[0] in
            ("k3", "k2", "net", "ddp_net")} == {}


def test_the_rng_state_matters_and_the_steps_after_the_suspend_count(worlds):
    load, _ = worlds
    for rank in (0, 1):
        straight = load["straight"][rank]
        for phase in ("resume-no-rng", "suspend"):
            moved = {k.split(".")[0] for k, d in _differences(straight, load[phase][rank]).items() if d > 1e-4}
            assert moved >= set(FRAMEWORKS), f"rank {rank}, {phase}: only {moved} differ from the straight run"


def test_the_reports_name_what_was_replayed_and_loaded(worlds):
    _, reports = worlds
    for rank in (0, 1):
        saved = reports["first"][rank]["suspend"]["save"]
        assert saved["rank"] == rank and saved["bytes"] > 0
        assert set(saved["unsaved"]) == {"opt", "ddp"}
        assert "DistributedDataParallel" in saved["unsaved"]["ddp"]
        assert "hvd.DistributedOptimizer" in saved["unsaved"]["opt"]
        assert {"k3", "k2", "net", "ddp_net", "ddp_opt", "train", "step", "x"} <= set(saved["saved"])
        resumed = reports["second"][rank]["resume"]
        assert resumed["restore"]["rank"] == rank and resumed["restore"]["unsaved"] == ["ddp", "opt"]
        assert resumed["reconcile"] == {"loaded": ["ddp", "ddp_net", "ddp_opt", "opt"], "kept_restored": [],
                                        "not_loaded": {}}
        assert resumed["restore"]["lost"] == {}
