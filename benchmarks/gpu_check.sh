#!/usr/bin/env bash
# The device check: everything a lent GPU machine must confirm, in one run of at most 420 s (the steps'
# limits added up), one rank on the one GPU with the reduction forced (HVD_NOTEBOOK_REDUCE_ALONE=1: one
# rank reduces its gradients as more ranks do). Made for the device tool's machines (Python 3.12 with
# PyTorch, CuPy, mpi4py and NCCL; no TensorFlow; no network).
#
#   bash benchmarks/gpu_check.sh --build       # here: build/gpu-wheels (what the machine lacks, this package)
#   GPU_CHECK_OUT=$OUT bash benchmarks/gpu_check.sh   # there, build/gpu-wheels carried
#   bash benchmarks/gpu_check.sh --rehearse    # here: the same steps on CPUs (gloo, torch.distributed
#                                              # transport), GPU-only rows skipped with the reason
#
# Steps (each in a process session of its own, ended whole, with whatever carries its mark, at its limit):
#   setup  50 s: the machine has what the check needs (exit 2 names what is missing); what it lacks of
#                ipyparallel, IPython, ipykernel, ipywidgets, bqplot, nvidia-ml-py and MPICH from the wheels;
#   rows  150 s: benchmarks/mpi_gpu_worker.py under mpiexec -n 1: hvd.allreduce of 1 MiB vs raw dist.all_reduce
#                and raw cupy NCCL; ResNet-50's 161 gradients grouped vs one raw call; the host back from
#                backward + step() before a queued 0.2 s GPU sleep ends, the values right after a synchronize;
#                a step under set_sync_debug_mode("error"); a ResNet-50 step, DistributedOptimizer vs DDP;
#   tests 120 s: pytest's `gpu` tests (tests/parallel/test_torch_gpu.py, and test_array_backend.py: cupy arrays
#                through NCCL, the path of TensorFlow's GPU tensors, which never reaches this machine) under
#                mpiexec -n 1;
#   cell   70 s: benchmarks/gpu_cell_check.py: %hvd start -n 1 --framework torch, a ResNet-50 step in a %%hvd cell;
#   panel  30 s: benchmarks/gpu_panel_check.py: the JupyterLab panel's GPU reader (NVML).
# The log goes to $GPU_CHECK_OUT/gpu-check.log as it is written; $GPU_CHECK_OUT/gpu-check.json is rewritten
# after every step (steps, rows against their targets, checks, tests, cell, panel), so a step that times out,
# or the whole command killed, still leaves the summary of what ran. GPU_CHECK_OUT defaults to $OUT where that
# is set, else build/gpu-check (build/gpu-check-rehearsal with --rehearse). Settings: PYTHON, GPU_WHEELS
# (default build/gpu-wheels), GPU_CHECK_QUICK=1 (fewer repetitions).
# Exit status: 0 when every step ended 0 and every check held (timings are a report), 1 otherwise, 2 when
# the machine lacks what the check needs.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
SELF=benchmarks/gpu_check.sh
export GPU_WHEELS=${GPU_WHEELS:-build/gpu-wheels}
export GPU_CHECK_QUICK=${GPU_CHECK_QUICK:-}

needs() {
  echo "gpu_check: cannot run: $*" >&2
  echo "gpu_check: needs an NVIDIA GPU and a Python with PyTorch's CUDA build and mpi4py; the rest comes from" \
    "the wheel folder that 'bash $SELF --build' makes here (see the top of $SELF)" >&2
  exit 2
}

python_path() {  # the Python to use, by its path: mpiexec's ranks may see another PATH
  local py=${PYTHON:-}
  if [ -z "$py" ]; then
    if [ "${GPU_CHECK_REHEARSE:-}" = 1 ] && [ -x .venv/bin/python ]; then py=.venv/bin/python
    elif command -v python3 >/dev/null 2>&1; then py=python3
    else py=.venv/bin/python; fi
  fi
  command -v "$py" >/dev/null 2>&1 || needs "no Python at '$py'"
  "$py" -c 'import sys; print(sys.executable)'
}

mpiexec_path() {  # beside the Python first (MPICH's wheel, a venv), else PATH's
  local beside
  beside=$(dirname "$PY")/mpiexec
  if [ -x "$beside" ]; then echo "$beside"; else command -v mpiexec || echo mpiexec; fi
}

build() {  # here: the wheel folder to carry, and the size of all that travels
  bash scripts/gpu-wheels.sh "$GPU_WHEELS" || exit 1
  local tree wheels
  tree=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  wheels=$(du -sb "$GPU_WHEELS" | cut -f1)
  echo "gpu_check --build: working tree $((tree >> 20)) MiB + $GPU_WHEELS $((wheels >> 20)) MiB travel (<= 64 MiB)"
  [ $((tree + wheels)) -lt $((64 << 20)) ] || { echo "gpu_check --build: over the 64 MiB a device call carries" >&2; exit 1; }
  echo "then, on the device: run(command='GPU_CHECK_OUT=\$OUT bash $SELF', carry=['$GPU_WHEELS'], timeout_s=480)"
}

# ------------------------------------------------------------------------------------------- the steps
step_setup() {
  if [ "$GPU_CHECK_REHEARSE" = 1 ]; then
    "$PY" -c 'import torch, torch.distributed, mpi4py.MPI' || needs "$PY cannot import torch or mpi4py"
    [ -x "$MPIEXEC" ] || command -v "$MPIEXEC" >/dev/null || needs "no mpiexec"
    return 0
  fi
  command -v nvidia-smi >/dev/null 2>&1 || needs "nvidia-smi is not on PATH (no NVIDIA driver here?)"
  nvidia-smi -L | grep -q '^GPU ' || needs "nvidia-smi lists no GPU"
  nvidia-smi -L | head -1
  "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' || needs "PyTorch in $PY does not see the GPU"
  "$PY" -c 'import mpi4py' || needs "$PY cannot import mpi4py"
  local missing
  missing=$("$PY" -c 'import importlib.util as u; print(" ".join(m for m in ("ipyparallel", "IPython", "ipykernel",
    "ipywidgets", "bqplot", "pynvml") if u.find_spec(m) is None))')
  local pip=("$PY" -m pip install --quiet --no-index --no-cache-dir --find-links "$GPU_WHEELS")
  if [ -n "$missing" ]; then
    [ -d "$GPU_WHEELS" ] || needs "$PY lacks $missing and there is no wheel folder at $GPU_WHEELS ($SELF --build)"
    echo "installing from $GPU_WHEELS (lacking: $missing)"
    "${pip[@]}" ipyparallel ipykernel ipython ipywidgets bqplot nvidia-ml-py || needs "installing from $GPU_WHEELS failed"
  fi
  if ! "$PY" -c 'from mpi4py import MPI' 2>/dev/null || ! command -v "$MPIEXEC" >/dev/null; then
    echo "installing MPICH's wheel from $GPU_WHEELS (no working MPI here)"
    "${pip[@]}" mpich || needs "no working MPI, and installing mpich from $GPU_WHEELS failed"
  fi
  "$PY" -c 'from mpi4py import MPI; print("MPI:", MPI.Get_library_version().splitlines()[0])' || needs "no MPI"
}

step_rows() {
  "$MPIEXEC" -n 1 "$PY" benchmarks/mpi_gpu_worker.py "$OUTDIR/rows.json" ${REHEARSE:+--cpu} ${QUICK:+--quick}
}

step_tests() {
  local tests=(tests/parallel/test_torch_gpu.py tests/parallel/test_array_backend.py)
  [ "$GPU_CHECK_REHEARSE" = 0 ] && "$PY" -c 'import tensorflow' 2>/dev/null && tests+=(tests/parallel/test_nccl.py)
  "$MPIEXEC" -n 1 "$PY" -m pytest -q -rs -p no:cacheprovider -o addopts= -m gpu --junitxml "$OUTDIR/gpu-tests.xml" \
    "${tests[@]}"
}

step_cell() {
  "$PY" benchmarks/gpu_cell_check.py "$OUTDIR/cell.json" ${REHEARSE:+--cpu} ${QUICK:+--quick}
}

step_panel() {
  if [ "$GPU_CHECK_REHEARSE" = 1 ]; then
    echo '{"skipped": "no GPU (the CPU rehearsal): NVML needs an NVIDIA driver"}' > "$OUTDIR/panel.json"
    return 0
  fi
  "$PY" benchmarks/gpu_panel_check.py "$OUTDIR/panel.json"
}

# --------------------------------------------------------------------------------------- the step runner
alive() {  # a process that has not exited (a zombie has)
  local state
  state=$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null) && [ "$state" != Z ]
}

reap() {  # every process carrying the step's mark in its environment, in whatever session it put itself
  local e
  for e in /proc/[0-9]*/environ; do
    grep -qxz "GPU_CHECK_STEP=$1" "$e" 2>/dev/null && kill -KILL "$(basename "$(dirname "$e")")" 2>/dev/null
  done
}

step() {  # step NAME LIMIT: `$SELF --step NAME` in a session of its own, ended whole at LIMIT seconds
  local name=$1 limit=$2 t0 pid rc timed_out=false mark
  mark="$name.$$.$RANDOM"
  echo "== $name (at most $limit s)"
  t0=$(date +%s)
  GPU_CHECK_STEP=$mark setsid bash "$SELF" --step "$name" &
  pid=$!
  while alive "$pid" && [ $(($(date +%s) - t0)) -lt "$limit" ]; do sleep 0.2; done
  if alive "$pid"; then
    timed_out=true
    echo "gpu_check: step $name ran past its $limit s: ending its process group"
    kill -TERM -- "-$pid" 2>/dev/null
    sleep 2
  fi
  kill -KILL -- "-$pid" 2>/dev/null  # the group, and what it left behind
  wait "$pid"
  rc=$?
  reap "$mark"
  $timed_out && rc=124
  printf '{"step": "%s", "rc": %d, "seconds": %d, "limit_s": %d, "timed_out": %s}\n' \
    "$name" "$rc" $(($(date +%s) - t0)) "$limit" "$timed_out" >> "$OUTDIR/steps.jsonl"
  "$PY" benchmarks/bench_gpu.py summarize "$OUTDIR"
  return "$rc"
}

case "${1:-}" in
  --build) build; exit ;;
  --step) "step_$2"; exit ;;  # in the step's own session (step() above)
  --rehearse) export GPU_CHECK_REHEARSE=1 ;;
  "") export GPU_CHECK_REHEARSE=${GPU_CHECK_REHEARSE:-0} ;;
  *) echo "usage: $SELF [--build | --rehearse]" >&2; exit 2 ;;
esac

if [ "$GPU_CHECK_REHEARSE" = 1 ]; then
  export OUTDIR=${GPU_CHECK_OUT:-build/gpu-check-rehearsal} REHEARSE=1 CUDA_VISIBLE_DEVICES= \
    HVD_NOTEBOOK_TORCH_TRANSPORT=dist
else
  export OUTDIR=${GPU_CHECK_OUT:-${OUT:-build/gpu-check}} REHEARSE= CUDA_VISIBLE_DEVICES=0 HVD_PARALLEL_REQUIRE_NCCL=1
fi
export QUICK=$GPU_CHECK_QUICK PYTHONUNBUFFERED=1 HVD_NOTEBOOK_REDUCE_ALONE=1 HVD_PARALLEL=1 HVD_PARALLEL_MIN_RANKS=1 \
  HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=120 TF_CPP_MIN_LOG_LEVEL=2
# this checkout's package, for the scripts and the ranks (a script under benchmarks/ would not find it)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the machine's MPI may be Open MPI, whose mpiexec refuses root unless told twice (the device machine runs as root)
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mkdir -p "$OUTDIR" || exit 2
rm -f "$OUTDIR"/{steps.jsonl,rows.json,gpu-tests.xml,cell.json,panel.json,gpu-check.json,gpu-check.log}
exec > >(tee -a "$OUTDIR/gpu-check.log") 2>&1
PY=$(python_path) || exit 2
export PY MPIEXEC
MPIEXEC=$(mpiexec_path)
echo "gpu_check $(date -u +%FT%TZ): $([ "$GPU_CHECK_REHEARSE" = 1 ] && echo "rehearsal on CPUs" || echo "on the GPU")," \
  "$PY, figures in $OUTDIR"

step setup 50
case $? in 0) ;; 2) exit 2 ;; *) exit 1 ;; esac
MPIEXEC=$(mpiexec_path)  # setup may have installed MPICH's beside the Python
step rows 150
step tests 120
step cell 70
step panel 30
"$PY" benchmarks/bench_gpu.py summarize "$OUTDIR" --print
"$PY" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["passed"] else 1)' "$OUTDIR/gpu-check.json"
rc=$?
echo "gpu_check: figures in $OUTDIR/gpu-check.json (commit a real run's as benchmarks/results/<date>-<gpu>.json)"
exit $rc
