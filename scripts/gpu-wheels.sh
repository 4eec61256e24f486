#!/usr/bin/env bash
# Builds the wheel folder that benchmarks/gpu_check.sh installs from on the lent GPU machine, which has
# Python 3.12 with PyTorch, CuPy, mpi4py and NCCL but no network: the few packages it lacks (ipyparallel,
# IPython and ipykernel with their small dependencies, the dashboard's ipywidgets and bqplot, MPICH's
# wheel for an mpiexec) and this package itself. What the machine's image already has (the device
# tool's KINDS.md) is left out. Must stay under 64 MiB, what one device call carries.
#
#   bash scripts/gpu-wheels.sh [FOLDER]      # default build/gpu-wheels; make gpu-wheels runs it
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-build/gpu-wheels}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
rm -rf "$OUT"
mkdir -p "$OUT"
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64 any; do
  PLATFORMS+=(--platform "$p")
done
"$PY" -m pip download --quiet --dest "$OUT" --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" "ipyparallel>=9,<10" "ipykernel>=6.29" "ipython>=8.20" "ipywidgets>=8.1,<9" "bqplot>=0.13" \
  "nvidia-ml-py>=12" "mpich>=4.2" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
# already in the machine's image: not carried (pip takes them from there)
for name in numpy pandas matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing python_dateutil six \
            psutil pygments packaging typing_extensions tzdata pytz; do
  rm -f "$OUT/$name"-*.whl
done
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$OUT" . >/dev/null
COUNT=$(ls "$OUT"/*.whl | wc -l)
BYTES=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
echo "gpu-wheels: $COUNT wheels, $((BYTES / 1048576)) MiB in $OUT"
[ "$BYTES" -lt $((64 * 1048576)) ] || { echo "gpu-wheels: over the 64 MiB a device call carries" >&2; exit 1; }
