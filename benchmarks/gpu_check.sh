#!/usr/bin/env bash
# GPU device check of hvd_notebook's NCCL path, from a bare machine with one NVIDIA GPU:
#   1. prints nvidia-smi;
#   2. makes a venv (${GPU_CHECK_VENV:-/tmp/hvd-gpu-venv}) and installs this checkout into it, wheels only,
#      with the [gpu,mpich] extras (TensorFlow's CUDA build, cupy, MPICH); where pyproject.toml's `gpu` extra
#      lacks cupy, or there is no `gpu`/`mpich` extra, the missing packages are named explicitly;
#   3. runs benchmarks/gpu_check.py under `mpiexec -n 1` (see its docstring for what it checks), writing
#      JSON to ${GPU_CHECK_OUT:-$OUT/gpu_check.json} (build/gpu_check.json where $OUT is unset);
#   4. prints the JSON and a summary; exits non-zero if any check failed.
#
#   bash benchmarks/gpu_check.sh            # from anywhere: it works in the checkout it belongs to
#
# Idempotent: a second run reuses the venv (a stamp of pyproject.toml, the checkout's path and the package
# list skips pip). Settings: GPU_CHECK_VENV, GPU_CHECK_OUT, GPU_CHECK_TIMEOUT (the check's limit, 420 s),
# GPU_CHECK_PIP_TIMEOUT (330 s), GPU_CHECK_PIP_ARGS (extra pip arguments, e.g. "--no-index --find-links
# /wheels" where no package index can be reached), GPU_CHECK_SKIP_INSTALL=1 (use the venv as it is),
# GPU_CHECK_ARGS (extra arguments for gpu_check.py, e.g. "--sections training,bandwidth").
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$(pwd)
VENV=${GPU_CHECK_VENV:-/tmp/hvd-gpu-venv}
if [ -n "${GPU_CHECK_OUT:-}" ]; then
  JSON=$GPU_CHECK_OUT
elif [ -n "${OUT:-}" ]; then
  JSON=$OUT/gpu_check.json
else
  JSON=$ROOT/build/gpu_check.json
fi
case $JSON in /*) ;; *) JSON=$ROOT/$JSON ;; esac
OUTDIR=$(dirname "$JSON")
mkdir -p "$OUTDIR" || exit 2
PIP_LOG=$OUTDIR/gpu_check_pip.log
CHECK_TIMEOUT=${GPU_CHECK_TIMEOUT:-420}
PIP_TIMEOUT=${GPU_CHECK_PIP_TIMEOUT:-330}
START=$(date +%s)

log() { printf '[%s +%3ss] %s\n' "$(date +%H:%M:%S)" "$(($(date +%s) - START))" "$*"; }

# A JSON saying why no check ran, so that a caller reading $JSON always finds an answer.
fail_setup() {
  local why=$1
  log "FAILED: $why"
  why=${why//\\/\/}
  why=${why//\"/\'}
  printf '{"check": "hvd_notebook GPU check (benchmarks/gpu_check.sh)", "complete": true, "ok": false, "stage": "setup", "failed": ["setup: %s"], "summary": ["gpu_check: FAILED: %s"]}\n' \
    "$why" "$why" >"$JSON"
  cat "$JSON"
  exit 2
}

show_pip_tail() {
  echo "----- last 40 lines of $PIP_LOG -----"
  tail -n 40 "$PIP_LOG"
  echo "-----"
  if grep -qiE 'NewConnectionError|Temporary failure in name resolution|Network is unreachable|No matching distribution|Could not find a version' "$PIP_LOG"; then
    log "hint: no package index reachable, or no wheel for this Python/platform; GPU_CHECK_PIP_ARGS='--no-index --find-links DIR' installs from wheels in DIR"
  fi
}

log "hvd_notebook GPU check in $ROOT; results to $JSON"
rm -f "$JSON" "$JSON.tmp"

# ---------------------------------------------------------------- the GPU
log "nvidia-smi:"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi || log "WARNING: nvidia-smi failed (exit $?); the check will say whether TensorFlow sees a GPU"
else
  log "WARNING: nvidia-smi is not on PATH; the check will say whether TensorFlow sees a GPU"
fi

# --------------------------------------------------------------- the venv
python_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }

make_venv() {
  local py=""
  for cand in python3 python3.13 python3.12 python3.11; do
    if command -v "$cand" >/dev/null 2>&1 && python_ok "$cand"; then py=$cand; break; fi
  done
  if [ -z "$py" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "no Python >= 3.11 found (hvd_notebook needs one); installing python3.11 with apt-get"
    apt-get update -qq >>"$PIP_LOG" 2>&1
    apt-get install -y -qq python3.11 python3.11-venv >>"$PIP_LOG" 2>&1 && py=python3.11
  fi
  [ -n "$py" ] || fail_setup "no Python >= 3.11 here (python3 is $(python3 --version 2>&1)); install one"
  log "creating the venv $VENV with $py ($("$py" --version 2>&1))"
  if ! "$py" -m venv "$VENV" >>"$PIP_LOG" 2>&1; then
    rm -rf "$VENV"
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      local ver
      ver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
      log "'$py -m venv' failed (no ensurepip?); installing python3-venv / python$ver-venv with apt-get"
      apt-get update -qq >>"$PIP_LOG" 2>&1
      apt-get install -y -qq "python$ver-venv" >>"$PIP_LOG" 2>&1 ||
        apt-get install -y -qq python3-venv >>"$PIP_LOG" 2>&1
      "$py" -m venv "$VENV" >>"$PIP_LOG" 2>&1 || { show_pip_tail; fail_setup "'$py -m venv $VENV' failed"; }
    else
      show_pip_tail
      fail_setup "'$py -m venv $VENV' failed; install your distribution's python3-venv"
    fi
  fi
}

: >"$PIP_LOG"
if ! { [ -x "$VENV/bin/python" ] && python_ok "$VENV/bin/python"; }; then
  rm -rf "$VENV"
  make_venv
else
  log "reusing the venv $VENV ($("$VENV/bin/python" --version 2>&1))"
fi
VPY=$VENV/bin/python

# What to install: the [gpu,mpich] extras as pyproject.toml has them, plus whatever they lack.
PLAN=$("$VPY" - <<'PY'
import re
import tomllib

project = tomllib.load(open("pyproject.toml", "rb")).get("project", {})
extras_defined = project.get("optional-dependencies", {})


def has(reqs, name):
    return any(re.split(r"[\s\[<>=!~;]", r.strip(), maxsplit=1)[0].lower().replace("_", "-").startswith(name)
               for r in reqs)


extras, packages = [], []
if "gpu" in extras_defined:
    extras.append("gpu")
    if not has(extras_defined["gpu"], "cupy"):
        packages.append("cupy-cuda12x")
else:
    packages += ["tensorflow[and-cuda]==2.21.0", "cupy-cuda12x"]
if "mpich" in extras_defined:
    extras.append("mpich")
else:
    packages.append("mpich")
if not has(project.get("dependencies", []), "mpi4py"):
    packages.append("mpi4py")
print(",".join(extras))
print(" ".join(packages))
PY
) || fail_setup "could not read pyproject.toml with $VPY"
EXTRAS=$(sed -n 1p <<<"$PLAN")
read -r -a PACKAGES <<<"$(sed -n 2p <<<"$PLAN")"
SPEC=.
[ -n "$EXTRAS" ] && SPEC=".[$EXTRAS]"
WHAT="pip install -e \"$SPEC\"${PACKAGES[*]:+ ${PACKAGES[*]}}"
read -r -a EXTRA_PIP_ARGS <<<"${GPU_CHECK_PIP_ARGS:-}"
STAMP_FILE=$VENV/.gpu-check-installed
STAMP="$(sha256sum pyproject.toml | cut -d' ' -f1) $ROOT $SPEC ${PACKAGES[*]:-} ${GPU_CHECK_PIP_ARGS:-}"

installed() {  # the stamp matches and the packages are there (found without importing TensorFlow)
  [ -f "$STAMP_FILE" ] && [ "$(cat "$STAMP_FILE")" = "$STAMP" ] &&
    "$VPY" -c 'import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in ("tensorflow", "keras", "cupy", "mpi4py", "hvd_notebook")))' 2>/dev/null
}

if [ "${GPU_CHECK_SKIP_INSTALL:-0}" = 1 ]; then
  log "GPU_CHECK_SKIP_INSTALL=1: using the venv as it is"
elif installed; then
  log "the venv is up to date (stamp matches): no pip"
else
  rm -f "$STAMP_FILE"
  export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
  log "upgrading pip (log: $PIP_LOG)"
  timeout 120 "$VPY" -m pip install --upgrade --only-binary=:all: --retries 2 --timeout 30 \
    "${EXTRA_PIP_ARGS[@]}" pip >>"$PIP_LOG" 2>&1 || log "WARNING: upgrading pip failed; going on with $("$VPY" -m pip --version 2>&1 | cut -d' ' -f1-2)"
  log "$WHAT (wheels only; TensorFlow's CUDA libraries are a few GB)"
  t0=$(date +%s)
  timeout "$PIP_TIMEOUT" "$VPY" -m pip install --only-binary=:all: --retries 2 --timeout 60 \
    "${EXTRA_PIP_ARGS[@]}" -e "$SPEC" "${PACKAGES[@]}" >>"$PIP_LOG" 2>&1
  rc=$?
  if [ "$rc" != 0 ]; then
    show_pip_tail
    [ "$rc" = 124 ] && fail_setup "pip install did not finish within ${PIP_TIMEOUT} s"
    fail_setup "$WHAT failed (exit $rc); see $PIP_LOG"
  fi
  log "installed in $(($(date +%s) - t0)) s"
  echo "$STAMP" >"$STAMP_FILE"
fi
"$VPY" - <<'PY' || true
import importlib.metadata as md

names = ["tensorflow", "keras", "cupy-cuda12x", "nvidia-nccl-cu12", "nvidia-cudnn-cu12", "mpi4py", "mpich", "numpy"]
found = []
for n in names:
    try:
        found.append(f"{n} {md.version(n)}")
    except md.PackageNotFoundError:
        found.append(f"{n} -")
print("  versions: " + ", ".join(found))
PY

# -------------------------------------------------------------- the check
CMD=("$VPY" -u benchmarks/gpu_check.py --out "$JSON")
read -r -a CHECK_ARGS <<<"${GPU_CHECK_ARGS:-}"
CMD+=("${CHECK_ARGS[@]}")
if [ -x "$VENV/bin/mpiexec" ]; then
  CMD=("$VENV/bin/mpiexec" -n 1 "${CMD[@]}")
else
  log "WARNING: no mpiexec in $VENV/bin (mpich extra missing?): running one process without it (MPI singleton)"
fi
log "running: timeout $CHECK_TIMEOUT ${CMD[*]}"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
timeout -k 15 "$CHECK_TIMEOUT" "${CMD[@]}"
rc=$?
case $rc in
  0) log "gpu_check.py: every check passed" ;;
  124 | 137) log "gpu_check.py: killed after ${CHECK_TIMEOUT} s; the JSON holds what ran before (see \"running\")" ;;
  *) log "gpu_check.py exited with $rc" ;;
esac

if [ ! -s "$JSON" ]; then
  fail_setup "gpu_check.py (exit $rc) wrote no JSON to $JSON"
fi
echo "===== $JSON ====="
cat "$JSON"
echo
echo "====="
"$VPY" - "$JSON" "$rc" <<'PY'
import json
import sys

data = json.load(open(sys.argv[1]))
print("\n".join(data.get("summary") or []))
if not data.get("complete"):
    print(f"gpu_check: INCOMPLETE (exit {sys.argv[2]}); it was running: {data.get('running')}")
PY
log "done in $(($(date +%s) - START)) s"
if [ "$rc" = 0 ] && "$VPY" -c 'import json, sys; sys.exit(json.load(open(sys.argv[1])).get("ok") is not True)' "$JSON"; then
  exit 0
fi
[ "$rc" = 0 ] && rc=1
exit "$rc"
