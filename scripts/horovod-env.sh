#!/usr/bin/env bash
# Build, once, a second environment with a real Horovod for the `horovod`
# backend tests (make test-horovod): TensorFlow 2.15.1 (the newest Horovod
# 0.28.1 compiles against) and Horovod compiled against the same MPI (MPICH
# from PyPI) as the main environment. About 15 minutes on 2 cores; cached in
# $HVD_HOROVOD_ENV (default ~/.cache/hvd_notebook/horovod-tf2.15) and reused.
set -euo pipefail
env_dir=${HVD_HOROVOD_ENV:-$HOME/.cache/hvd_notebook/horovod-tf2.15}
repo=$(cd "$(dirname "$0")/.." && pwd)
if [ -f "$env_dir/.complete" ]; then
  "$env_dir/bin/pip" install --quiet --no-deps -e "$repo"
  exit 0
fi
rm -rf "$env_dir"
mkdir -p "$(dirname "$env_dir")"
# TensorFlow 2.15 has wheels for Python 3.9 to 3.11 only: take such a Python explicitly, not the newest one
base=""
for cand in python3.11 python3.10 python3.9 python3; do
  if command -v "$cand" >/dev/null 2>&1 &&
     "$cand" -c 'import sys; sys.exit(not (3, 9) <= sys.version_info[:2] <= (3, 11))' 2>/dev/null; then
    base=$cand; break
  fi
done
if [ -z "$base" ]; then
  echo "make test-horovod needs Python 3.9, 3.10 or 3.11 (TensorFlow 2.15, the newest Horovod 0.28.1 builds" \
       "against, has no wheel for a newer one): install python3.11 (e.g. 'pyenv install 3.11', or your" \
       "distribution's python3.11 and python3.11-venv) and put it on PATH; then run make test-horovod again." >&2
  exit 1
fi
"$base" -m venv "$env_dir" || { echo "'$base -m venv' failed: install its venv module (e.g." \
  "'sudo apt-get install python3.11-venv'), then run make test-horovod again." >&2; exit 1; }
py="$env_dir/bin/python"
"$py" -m pip install --quiet --upgrade pip
"$py" -m pip install --quiet "tensorflow-cpu==2.15.1" "mpich" "mpi4py" "ipyparallel>=9" "ipykernel" \
  "psutil" "pytest" "pytest-timeout" "numpy<2" "cmake" "setuptools<70" "wheel" "packaging"
export PATH="$env_dir/bin:$PATH"
HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_GLOO=1 HOROVOD_WITHOUT_PYTORCH=1 \
  HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS=-j2 \
  "$py" -m pip install --no-build-isolation --no-cache-dir "horovod==0.28.1" "tensorflow-cpu==2.15.1" "numpy<2"
"$py" -m pip install --quiet --no-deps -e "$repo"
"$py" -c "import horovod.tensorflow as hvd; hvd.init(); print('horovod', hvd.size(), hvd.mpi_enabled())"
touch "$env_dir/.complete"
