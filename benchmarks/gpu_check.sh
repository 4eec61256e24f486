#!/usr/bin/env bash
# GPU check of hvd_notebook's NCCL path: correctness as pytest's `gpu` tests under mpiexec, then timings.
#
#   bash benchmarks/gpu_check.sh                     # from anywhere: it works in the checkout it belongs to
#
# What it needs, and checks first (exit status 2, saying what is missing, where something is):
#   - at least one NVIDIA GPU (nvidia-smi lists it);
#   - a Python ($PYTHON, else the checkout's .venv/bin/python, else python3) with this package and its
#     [gpu] extra: TensorFlow's CUDA build, cupy (NCCL through cupy.cuda.nccl), mpi4py; and pytest;
#     `make install` sets that up where nvidia-smi lists a GPU (it needs a package index: TensorFlow's
#     CUDA wheels are several GB);
#   - an mpiexec (beside that Python, else on PATH).
# The runtime's GPU path reduces TensorFlow tensors, so a machine with PyTorch and CuPy but no TensorFlow
# cannot run this check (a framework-neutral core is a later issue).
#
# What it runs, one rank per GPU (NCCL refuses two ranks on one GPU):
#   1. HVD_PARALLEL=1 HVD_PARALLEL_MIN_RANKS=1 HVD_PARALLEL_REQUIRE_NCCL=1 CUDA_VISIBLE_DEVICES=0,..,N-1 \
#        mpiexec -n N python -m pytest -m gpu tests/parallel/test_nccl.py
#      (HVD_PARALLEL_REQUIRE_NCCL=1: a test fails, instead of skipping, where NCCL is not enabled)
#   2. the fusion test again with HOROVOD_FUSION_THRESHOLD=0: one tensor per NCCL call;
#   3. python benchmarks/run.py gpu: hvd.allreduce against raw NCCL, 1 MiB .. 1 GiB, and
#      DistributedOptimizer against the plain optimizer; a table, figures in build/bench/gpu.json.
# Settings: PYTHON, GPU_CHECK_RANKS (default: the number of GPUs), GPU_CHECK_QUICK=1 (run.py --quick).
# Exit status: 0 when every test passed and the timing ran (its figures are a report), 1 otherwise, 2 when
# the machine lacks what the check needs.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

needs() {
  echo "gpu_check: cannot run: $*" >&2
  echo "gpu_check: needs an NVIDIA GPU and a Python with TensorFlow's CUDA build, cupy, mpi4py, pytest and" \
    "this package (make install, or pip install -e '.[gpu,mpich,test]'); see the top of $0" >&2
  exit 2
}

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
command -v "$PY" >/dev/null 2>&1 || needs "no Python at '$PY'"

command -v nvidia-smi >/dev/null 2>&1 || needs "nvidia-smi is not on PATH (no NVIDIA driver here?)"
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
[ "$GPUS" -gt 0 ] || needs "nvidia-smi lists no GPU"
nvidia-smi -L

"$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("tensorflow") is None)' ||
  needs "$PY has no TensorFlow. hvd_notebook's GPU path reduces TensorFlow tensors, so this check needs" \
    "TensorFlow's CUDA build (tensorflow[and-cuda]); PyTorch or JAX with CuPy is not enough until the" \
    "framework-neutral core (a later issue)"

MISSING=$("$PY" - <<'PY'
import importlib.util

names = {"cupy": "cupy (cupy-cuda12x)",
         "mpi4py": "mpi4py", "pytest": "pytest", "hvd_notebook": "this package (pip install -e .)"}
print("; ".join(what for name, what in names.items() if importlib.util.find_spec(name) is None))
PY
) || needs "$PY does not run"
[ -z "$MISSING" ] || needs "$PY lacks $MISSING"

"$PY" -c 'import sys, tensorflow as tf; sys.exit(not tf.config.list_physical_devices("GPU"))' 2>/dev/null ||
  needs "TensorFlow in $PY sees no GPU (tensorflow-cpu instead of tensorflow[and-cuda], or CUDA libraries missing)"

MPIEXEC=$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")/mpiexec
[ -x "$MPIEXEC" ] || MPIEXEC=$(command -v mpiexec) || needs "no mpiexec beside $PY or on PATH"

RANKS=${GPU_CHECK_RANKS:-$GPUS}
DEVICES=$(seq -s, 0 $((RANKS - 1)))
export HVD_PARALLEL=1 HVD_PARALLEL_MIN_RANKS=1 HVD_PARALLEL_REQUIRE_NCCL=1 CUDA_VISIBLE_DEVICES=$DEVICES \
  TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2} HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=120
PYTEST=("$MPIEXEC" -n "$RANKS" "$PY" -m pytest -q -rs -p no:cacheprovider -o addopts= -m gpu tests/parallel/test_nccl.py)

rc=0
echo "== 1. gpu tests on $RANKS rank(s), GPUs $DEVICES: ${PYTEST[*]}"
"${PYTEST[@]}" || rc=1
echo "== 2. the fusion test, unfused (HOROVOD_FUSION_THRESHOLD=0)"
HOROVOD_FUSION_THRESHOLD=0 "${PYTEST[@]}" -k fused_or_not || rc=1
echo "== 3. timings: $PY benchmarks/run.py gpu"
CUDA_VISIBLE_DEVICES=0 "$PY" benchmarks/run.py gpu ${GPU_CHECK_QUICK:+--quick} || rc=1
echo "gpu_check: $([ $rc = 0 ] && echo PASSED || echo FAILED)"
exit $rc
