#!/usr/bin/env bash
# GPU check of hvd_notebook's NCCL path, made for the lent GPU machine (the device tool's nvidia-h200:
# Python 3.12 with PyTorch, CuPy, mpi4py and NCCL; no TensorFlow; no network). It installs nothing from
# the network: the few packages that machine lacks come from a wheel folder built here and carried
# along (`make gpu-wheels`, under 64 MiB).
#
#   make gpu-wheels                                   # here: build/gpu-wheels
#   bash benchmarks/gpu_check.sh                      # there, in the checkout (build/gpu-wheels carried)
#
# What it needs, and checks first (exit status 2, saying what is missing, where something is):
#   - an NVIDIA GPU (nvidia-smi lists it);
#   - a Python ($PYTHON, else python3, else the checkout's .venv/bin/python) with PyTorch seeing the GPU,
#     cupy and mpi4py; ipyparallel, IPython, ipykernel, ipywidgets, bqplot, this package and an mpiexec
#     are installed from $GPU_WHEELS (default build/gpu-wheels) where they are missing.
# What it runs, on the one GPU with one rank (NCCL refuses two ranks on one GPU), within about 6 minutes:
#   1. pytest's `gpu` tests under mpiexec (HVD_PARALLEL_REQUIRE_NCCL=1: a test fails, instead of
#      skipping, where NCCL is not enabled): every collective on CUDA tensors from PyTorch and on cupy
#      arrays through NCCL, no trip through the host, stream ordering, DistributedOptimizer on a CUDA
#      model (tests/parallel/test_torch_gpu.py; tests/parallel/test_nccl.py too where TensorFlow is there);
#   2. benchmarks/gpu_cell_check.py: `%hvd start -n 1 --framework torch` on the GPU (pinning, NCCL
#      bootstrapped over MPI, torch.distributed on NCCL) and a ResNet-50 training step in a `%%hvd` cell
#      with DistributedOptimizer and the dashboard, against the same step in plain PyTorch (<= 1.03x);
#   3. benchmarks/run.py gpu: hvd.allreduce of a CUDA tensor vs raw NCCL (cupy) on the same memory,
#      1 .. 256 MiB (<= 1.05x).
#   4. hvd-notebook scaling -n 1 with HVD_NOTEBOOK_REDUCE_ALONE=1: a ResNet-50 step under
#      DistributedOptimizer (its gradients reduced in buckets, as on more ranks) vs DDP (<= 1.05x), and
#      each one's time over the compute alone (<= 1.2x).
#   5. benchmarks/gpu_panel_check.py: the JupyterLab panel's GPU reader (NVML through nvidia-ml-py): the
#      node's GPUs, and a process's GPU and the memory it holds there.
# It writes $GPU_CHECK_OUT/gpu-check.json (default build/gpu-check; on the device machine point it at $OUT)
# holding every figure, and prints a short table. Settings: PYTHON, GPU_WHEELS, GPU_CHECK_OUT,
# GPU_CHECK_QUICK=1 (fewer repetitions).
# Exit status: 0 when every test passed and the timings ran (their targets are a report), 1 otherwise, 2
# when the machine lacks what the check needs.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
START=$(date +%s)
WHEELS=${GPU_WHEELS:-build/gpu-wheels}
OUTDIR=${GPU_CHECK_OUT:-build/gpu-check}
QUICK=${GPU_CHECK_QUICK:+--quick}
mkdir -p "$OUTDIR"

needs() {
  echo "gpu_check: cannot run: $*" >&2
  echo "gpu_check: needs an NVIDIA GPU and a Python with PyTorch's CUDA build, cupy and mpi4py; the rest comes" \
    "from the wheel folder that 'make gpu-wheels' builds (see the top of $0)" >&2
  exit 2
}

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if command -v python3 >/dev/null 2>&1 && python3 -c 'import torch' 2>/dev/null; then PY=python3
  elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
  else PY=python3; fi
fi
command -v "$PY" >/dev/null 2>&1 || needs "no Python at '$PY'"
PY=$("$PY" -c 'import sys; print(sys.executable)')  # by its path: mpiexec's ranks may see another PATH
command -v nvidia-smi >/dev/null 2>&1 || needs "nvidia-smi is not on PATH (no NVIDIA driver here?)"
nvidia-smi -L | grep -q '^GPU ' || needs "nvidia-smi lists no GPU"
nvidia-smi -L | head -1

"$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null ||
  needs "PyTorch in $PY does not see the GPU (a CPU build, or no PyTorch)"
for module in cupy mpi4py; do
  "$PY" -c "import $module" 2>/dev/null || needs "$PY cannot import $module"
done

# what the machine lacks, from the carried wheels (never from the network)
missing=$("$PY" - <<'PY'
import importlib.util
print(" ".join(m for m in ("ipyparallel", "IPython", "ipykernel", "ipywidgets", "bqplot", "pynvml")
               if importlib.util.find_spec(m) is None))
PY
)
PIP=("$PY" -m pip install --quiet --no-index --find-links "$WHEELS")
if [ -n "$missing" ]; then
  [ -d "$WHEELS" ] || needs "$PY lacks $missing and there is no wheel folder at $WHEELS (make gpu-wheels)"
  echo "== installing from $WHEELS: ipyparallel ipykernel ipython ipywidgets bqplot nvidia-ml-py"
  "${PIP[@]}" ipyparallel ipykernel ipython ipywidgets bqplot nvidia-ml-py || needs "installing from $WHEELS failed"
fi
# this checkout's package, for the scripts and the ranks too (`python -c` finds it from here through the
# current directory, a script under benchmarks/ would not)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the machine's MPI may be Open MPI, whose mpiexec refuses root unless told twice (the device machine runs as root)
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPIEXEC=$(dirname "$PY")/mpiexec
if [ ! -x "$MPIEXEC" ]; then MPIEXEC=$(command -v mpiexec || true); fi
if [ -z "$MPIEXEC" ] || ! "$PY" -c 'from mpi4py import MPI' 2>/dev/null; then
  [ -d "$WHEELS" ] || needs "no working MPI (mpiexec, or mpi4py's library) and no wheel folder at $WHEELS"
  echo "== installing MPICH's wheel from $WHEELS (no working MPI here)"
  "${PIP[@]}" mpich || needs "installing mpich from $WHEELS failed"
  MPIEXEC=$(dirname "$PY")/mpiexec
  [ -x "$MPIEXEC" ] || needs "no mpiexec beside $PY after installing mpich"
fi
"$PY" -c 'from mpi4py import MPI; print("MPI:", MPI.Get_library_version().splitlines()[0])' || needs "mpi4py cannot load MPI"

export HVD_PARALLEL=1 HVD_PARALLEL_MIN_RANKS=1 HVD_PARALLEL_REQUIRE_NCCL=1 CUDA_VISIBLE_DEVICES=0 \
  HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=120 TF_CPP_MIN_LOG_LEVEL=2
TESTS=(tests/parallel/test_torch_gpu.py)
"$PY" -c 'import tensorflow' 2>/dev/null && TESTS+=(tests/parallel/test_nccl.py)

rc=0
echo "== 1. gpu tests, one rank on GPU 0: ${TESTS[*]}"
timeout 240 "$MPIEXEC" -n 1 "$PY" -m pytest -q -rs -p no:cacheprovider -o addopts= -m gpu \
  --junitxml "$OUTDIR/gpu-tests.xml" "${TESTS[@]}" || rc=1
echo "== 2. %hvd start --framework torch on the GPU, a ResNet-50 step in a %%hvd cell vs plain PyTorch"
timeout 240 "$PY" benchmarks/gpu_cell_check.py "$OUTDIR/cell.json" $QUICK || rc=1
echo "== 3. timings: hvd.allreduce vs raw NCCL, 1 .. 256 MiB"
timeout 180 "$PY" benchmarks/run.py gpu $QUICK && cp build/bench/gpu.json "$OUTDIR/allreduce.json" || rc=1
echo "== 4. a ResNet-50 step under DistributedOptimizer vs DDP, the reduction forced on one rank"
HVD_NOTEBOOK_REDUCE_ALONE=1 timeout 240 "$PY" -m hvd_notebook.cli scaling -n 1 --model resnet50 --batch 64 \
  --rounds 3 ${QUICK:+--steps 5} --out "$OUTDIR/scaling.json" || rc=1
echo "== 5. the JupyterLab panel's GPU reader (NVML): the node's GPUs, a process's GPU memory"
timeout 60 "$PY" benchmarks/gpu_panel_check.py "$OUTDIR/panel.json" || rc=1

"$PY" - "$OUTDIR" "$rc" "$(($(date +%s) - START))" <<'PY'
import json, os, subprocess, sys, time
import xml.etree.ElementTree as ET

out, rc, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip().splitlines()
except OSError:
    gpu = []
report = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu[0] if gpu else "", "passed": rc == 0, "seconds": seconds,
          "cell": load("cell.json"), "allreduce": load("allreduce.json"), "scaling": load("scaling.json"),
          "panel": load("panel.json")}
tests = os.path.join(out, "gpu-tests.xml")
if os.path.exists(tests):
    root = ET.parse(tests).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    report["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
json.dump(report, open(os.path.join(out, "gpu-check.json"), "w"), indent=2)
print(f"\n== gpu_check {report['date']}: {'PASSED' if rc == 0 else 'FAILED'} in {seconds} s")
if "tests" in report:
    t = report["tests"]
    print(f"gpu tests: {t['tests']} run, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped")
if report["cell"]:
    c = report["cell"]
    print(f"{c['model']} step, batch {c['batch']}: %%hvd cell {c['cell_step_s'] * 1e3:.1f} ms vs plain "
          f"{c['plain_step_s'] * 1e3:.1f} ms = {c['ratio']:.3f}x (target <= 1.03x) on {c['rank_device']}")
if report["allreduce"]:
    for row in report["allreduce"]["rows"]:
        target = row["target_max_ratio"]
        print(f"{row['measure']}: {row['ours']:.3f} vs {row['baseline']:.3f} {row['unit']} = {row['ratio']:.3f}x "
              + (f"(target <= {target}x)" if target else "(a report)"))
if report["scaling"]:
    p = report["scaling"]["points"][0]
    print(f"{p['model']} step, batch {p['batch']}, reduction forced on one rank: DistributedOptimizer "
          f"{p['hvd_step_s'] * 1e3:.1f} ms vs DDP {p['ddp_step_s'] * 1e3:.1f} ms = "
          f"{p['hvd_step_s'] / p['ddp_step_s']:.3f}x (target <= 1.05x); over the compute alone "
          f"({p['compute_s'] * 1e3:.1f} ms) {(p['hvd_step_s'] - p['compute_s']) * 1e3:.1f} vs "
          f"{(p['ddp_step_s'] - p['compute_s']) * 1e3:.1f} ms (target <= 1.2x)")
PY
echo "gpu_check: $([ $rc = 0 ] && echo PASSED || echo FAILED); figures in $OUTDIR/gpu-check.json (commit it as" \
  "benchmarks/results/<date>-<gpu>.json)"
exit $rc
