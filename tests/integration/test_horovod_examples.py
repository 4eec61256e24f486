"""Horovod's own example scripts (tests/horovod_examples/, v0.28.1, byte for byte) on Keras 2 (``tf_keras``, by
``TF_USE_LEGACY_KERAS=1``), unchanged: each under ``horovodrun -np 2``, and the Keras benchmark's text as a
``%%hvd`` cell on a cluster started with ``--env TF_USE_LEGACY_KERAS=1``, its ``fit`` followed by the dashboard.
(Without the variable the scripts fail on Keras 3: ``opt.variables()`` is a list there, and ``compile`` refuses
``experimental_run_tf_function``.) The arguments are tiny: a run is mostly TensorFlow's import and tracing."""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
from conftest import ROOT_DIR, assert_gone, left_running

EXAMPLES = ROOT_DIR / "tests" / "horovod_examples"
BIN = Path(sys.executable).parent
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # `python` is this environment's
       "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}

# Horovod v0.28.1 (1d217b59949986d025f6db93c49943fb6b6cc78f): examples/tensorflow2/ and examples/elastic/tensorflow2/
SHA256 = {
    "tensorflow2_synthetic_benchmark.py": "f59fdc77495f955ed22198a84e7d1127721b85731bb466427974069222aceb95",
    "tensorflow2_keras_synthetic_benchmark.py": "01c441525291036ef7ce596bb9c3b4ca9faab96da94b52e8a97729b9d28705fd",
    "tensorflow2_synthetic_benchmark_elastic.py": "d32b34a877a833ee359699271493556b50b22da8a7d33b63b464c7272ffa16a2",
}
# MobileNet (v1): less to trace than MobileNetV2 (a run took about 1.5x as long with that here); two
# iterations, as the Keras benchmark leaves its first (warm-up) epoch out of the mean
TINY = ["--no-cuda", "--model", "MobileNet", "--batch-size", "2", "--num-iters", "2", "--num-batches-per-iter", "1"]
WARMUP = ["--num-warmup-batches", "1"]  # (the two tf.function benchmarks have it, the Keras one not)
# a seed per rank, before the Keras benchmark's text in a cell: the ranks' synthetic batches differ (a noise scale
# to measure) and are the same in every run (unseeded, the 2 steps' noise scale is NaN in about half the runs)
SEEDED = ("import tensorflow as tf\nimport horovod.tensorflow.keras as hvd\nhvd.init()\n"
          "tf.keras.utils.set_random_seed(30 + hvd.rank())\n")
# the scripts' own result line (in a cell, with the rank's prefix)
RESULT = re.compile(r"^(?:\[0\] )?Total img/sec on 2 CPU\(s\): (\d+\.\d) \+-(\d+\.\d)$", re.M)


def test_the_examples_are_horovods_unchanged():
    for name, digest in SHA256.items():
        assert hashlib.sha256((EXAMPLES / name).read_bytes()).hexdigest() == digest, f"{name} was changed"


@pytest.mark.parametrize("name, extra", [
    ("tensorflow2_synthetic_benchmark.py", WARMUP),
    ("tensorflow2_keras_synthetic_benchmark.py", []),
    ("tensorflow2_synthetic_benchmark_elastic.py", WARMUP),
], ids=["tensorflow2", "keras", "elastic"])
def test_an_example_runs_unchanged_under_horovodrun(name, extra, tmp_path):
    script = tmp_path / name  # (a copy in the test's own folder: its path marks the job's processes)
    shutil.copyfile(EXAMPLES / name, script)
    started = time.monotonic()
    proc = subprocess.Popen([str(BIN / "horovodrun"), "-np", "2", "python", str(script), *TINY, *extra], cwd=tmp_path,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # as a user would stop it
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"{name} did not end within 300 s:\n{out}\n{err[-4000:]}")
    seconds = time.monotonic() - started
    assert proc.returncode == 0, f"{name}: exit code {proc.returncode}\n{out}\n{err[-4000:]}"
    found = RESULT.search(out)
    assert found, f"{name}: no result line\n{out}\n{err[-4000:]}"
    # rank 0 alone logs: one copy of each line
    assert out.count("Number of CPUs: 2") == 1 and out.count("Total img/sec") == 1, out
    total = float(found[1])
    assert total > 0, f"{name}: {found[0]} ({seconds:.0f} s)"
    sys.__stderr__.write(f"\n[horovod example] {name}: {found[0]} ({seconds:.0f} s)\n")
    assert not left_running(str(tmp_path))


def test_the_keras_example_as_a_cell_on_keras_2(session, run, ip):
    result, out = run("%hvd start -n 2 --env TF_USE_LEGACY_KERAS=1 --env TF_CPP_MIN_LOG_LEVEL=2")
    assert result.success, out
    pids = session.cluster.pids()
    keras2 = f"Keras 2 (tf_keras {version('tf_keras')})"
    result, out = run("%hvd status")
    assert result.success and keras2 in out, out
    argv = ["tensorflow2_keras_synthetic_benchmark.py", *TINY]
    source = (EXAMPLES / "tensorflow2_keras_synthetic_benchmark.py").read_text()
    result, out = run(f"%%hvd --progress text\n{SEEDED}import sys\nsys.argv = {argv!r}\n{source}")
    assert result.success, out
    found = RESULT.search(out)
    assert found and float(found[1]) > 0, out
    # the dashboard followed the fit (verbose=0 and all): a line per epoch over both ranks
    epochs = [line for line in out.splitlines() if line.startswith("[hvd_notebook] fit epoch ")]
    assert [line.split(" | ")[:2] for line in epochs] == [["[hvd_notebook] fit epoch 1/2", "2 ranks"],
                                                         ["[hvd_notebook] fit epoch 2/2", "2 ranks"]], out
    # rank 0's History, with the gradient noise scale the runtime adds to fit's logs on Keras 2 too
    result, out = run("%%hvd\nfit_logs = model.history.history\nfigure_now = hvd.noise_scale()")
    assert result.success, out
    for name in ("fit_logs", "figure_now"):
        result, out = run(f"%hvd pull {name}")
        assert result.success, out
    logs, now = ip.user_ns.pop("fit_logs"), ip.user_ns.pop("figure_now")
    assert {"loss", "noise_scale"} <= set(logs) and len(logs["loss"]) == len(logs["noise_scale"]) == 2, logs
    # On 2 ranks the |G|^2 estimate is the dot product of their gradients: on these random labels, unseeded,
    # negative in about half the runs after the 2 steps, and the noise scale then NaN (no figure yet). Seeded
    # (SEEDED), both epochs have a figure: positive, the last the optimizer's own. The dashboard shows the
    # figure of each epoch that has one; its line carries the last step's figure, which History's (taken at the
    # epoch's end, after that step's update) may turn to NaN: a figure shown is a finite one
    figures = logs["noise_scale"]
    assert any(math.isfinite(f) for f in figures), logs
    assert all(f > 0 for f in figures if math.isfinite(f)), logs
    assert not math.isfinite(figures[-1]) or figures[-1] == pytest.approx(now, rel=1e-5), (logs, now)
    for line, figure in zip(epochs, figures):
        shown = line.split(" noise_scale ", 1)[1].split()[0] if " noise_scale " in line else None
        assert (shown is not None) >= math.isfinite(figure), (line, logs)
        assert shown is None or (math.isfinite(float(shown)) and float(shown) > 0), (line, logs)
    sys.__stderr__.write(f"\n[horovod example] the Keras benchmark in a cell: {found[0]}; noise scale by epoch "
                         f"{logs['noise_scale']}\n")
    result, out = run("%hvd stop")
    assert result.success and session.cluster is None, out
    assert_gone(pids)
