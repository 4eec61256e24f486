#!/usr/bin/env bash
# The part of the suite that needs no root, once more as an unprivileged user (docs/testing.md#as-an-unprivileged-user).
# `make test` runs this before its main pytest run (so that the whole suite's summary ends the output). Run as root (as CI runs it), it:
#   - creates the system user $HVD_TEST_USER (default hvd-ci) with a home (reused when it exists);
#   - lets that user reach the clone, .venv and the Python .venv was made from (which may lie under root's
#     home): o+x (traverse only, not read) on each folder above them that lacks it, put back at the end;
#   - runs as that user, with HOME its home, TMPDIR a fresh folder in that home and a clean environment:
#       1. pytest on the chosen tests below (or on this script's arguments), without pytest's cache and with
#          --basetemp under its TMPDIR, `make demo`'s test among them (the executed notebook goes under its
#          TMPDIR: the clone is root's; make test's root run then leaves that test out);
#       2. a check that it wrote nothing outside its home (so nothing outside HOME and TMPDIR);
#   - kills whatever of the user's processes is left (pkill -u) and removes its TMPDIR.
# Exits 1 where a part failed, so `make test` fails. Run as any other user, `make test`'s pytest run already
# was the unprivileged run: this script says so and does nothing.
#
#   bash scripts/test-unprivileged.sh                       # the chosen part (what `make test` runs)
#   bash scripts/test-unprivileged.sh tests/unit -x         # these pytest arguments instead
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
U=${HVD_TEST_USER:-hvd-ci}
SAY="test-unprivileged:"

# The part that needs no root, chosen to fit ~2.5 minutes on 2 cores: the unit files that deal with uids, file
# modes and owners, private folders, the node's shared files and other users' processes (where being root
# changes what the code may do; a new unit file of that kind belongs here); start, restart and stop, and a kernel
# killed with its cluster reaped; `hvd-notebook list/clean` of an orphaned cluster beside a live one;
# loopback-only sockets, 0600/0700 files and encryption; the panel's HTTP routes (test_lab_http.py); `make
# demo`'s test (scripts/demo.py, the target's recipe, and its output checked).
# Left out: the rest of the unit tier (pure functions, the layer rules, lint, docs: the same as root), what
# needs root (netns, Slurm, the hub, useradd), what writes into the clone (benchmarks), the node-sharing rules
# on real kernels (test_sharing.py: the root run has them, and test_hostile.py runs clusters as two
# unprivileged users), and the long remainder (cells, parallel, notebooks, browser), which the root run covers
# with the same code.
TESTS=(
  tests/unit/test_{private,cluster_workdir,keycopy,leases,setup_node,queue_rules,policy,shm,rankwatch,lab_units}.py
  tests/unit/test_{suspension_units,cluster_placement}.py
  "tests/integration/test_notebooks.py::test_make_demo_runs_the_quickstart_and_prints_its_summary"
  "tests/integration/test_lifecycle.py::test_start_table_status_restart_stop"
  "tests/integration/test_lifecycle.py::test_kernel_shutdown_stops_the_cluster"
  "tests/integration/test_reliability.py::test_clean_stops_orphaned_clusters_and_leaves_live_ones"
  "tests/integration/test_reliability.py::test_only_loopback_private_files_and_encrypted_messages"
  tests/integration/test_lab_http.py
)
if [ $# -gt 0 ]; then TESTS=("$@"); fi

if [ "$(id -u)" != 0 ]; then
  echo "$SAY the suite ran as $(id -un) (uid $(id -u)), not root: that was the unprivileged run; nothing more to do."
  exit 0
fi
for tool in useradd runuser pkill pgrep find; do
  command -v "$tool" >/dev/null || { echo "$SAY $tool is missing: cannot run the unprivileged part." >&2; exit 1; }
done
[ -x .venv/bin/python ] || { echo "$SAY .venv is missing: run make install first." >&2; exit 1; }

if ! id -u "$U" >/dev/null 2>&1; then
  useradd --system --create-home --shell /bin/bash "$U"
  echo "$SAY created the system user $U"
fi
HOME_U=$(getent passwd "$U" | cut -d: -f6)
GROUP_U=$(id -gn "$U")
[ -d "$HOME_U" ] || install -d -o "$U" -g "$GROUP_U" -m 0700 "$HOME_U"
TMP_U=$HOME_U/tmp
pkill -KILL -u "$U" 2>/dev/null || true  # (a run killed before its clean-up)
rm -rf "$TMP_U"
install -d -o "$U" -g "$GROUP_U" -m 0700 "$TMP_U"

# o+x on the folders above these that lack it; the old modes, to put back
CHANGED=()
traversable() {
  local dir=$1 mode
  while [ "$dir" != / ]; do
    dir=$(dirname "$dir")
    mode=$(stat -c %a "$dir")
    if (( (8#$mode & 1) == 0 )); then
      CHANGED+=("$mode $dir")
      chmod o+x "$dir"
    fi
  done
}

cleanup() {
  pkill -KILL -u "$U" 2>/dev/null || true
  for entry in "${CHANGED[@]}"; do chmod "${entry%% *}" "${entry#* }"; done
  [ ${#CHANGED[@]} -eq 0 ] || echo "$SAY modes put back on: $(printf '%s, ' "${CHANGED[@]#* }" | sed 's/, $//')"
  CHANGED=()
  rm -rf "$TMP_U"
}
FAILED=0
trap 'cleanup; exit 130' INT TERM
trap 'cleanup; [ "$FAILED" = 0 ] || exit 1' EXIT

REAL_PY=$(realpath .venv/bin/python)
BASE=$(.venv/bin/python -c 'import sys; print(sys.base_prefix)')
traversable "$REPO/.venv"
traversable "$REAL_PY"
traversable "$BASE/lib"
[ ${#CHANGED[@]} -eq 0 ] || echo "$SAY o+x (traverse only) for $U on: $(printf '%s, ' "${CHANGED[@]#* }" | sed 's/, $//')"

# a clean environment: the user's HOME and TMPDIR, a plain PATH, and this run's HVD_* settings and CI
ENV=(HOME="$HOME_U" USER="$U" LOGNAME="$U" SHELL=/bin/bash PATH=/usr/local/bin:/usr/bin:/bin
     LANG="${LANG:-C.UTF-8}" TMPDIR="$TMP_U")
[ -z "${CI:-}" ] || ENV+=(CI="$CI")
while IFS= read -r var; do ENV+=("$var=${!var}"); done < <(compgen -e | grep '^HVD_' || true)
as_user() { runuser -u "$U" -- env -i "${ENV[@]}" "$@"; }

if ! as_user test -r "$REPO/pyproject.toml" || ! as_user "$REPO/.venv/bin/python" -c 'import hvd_notebook, pytest'; then
  echo "$SAY $U cannot read the clone or run .venv/bin/python: are their files readable by others (umask 022)?" >&2
  FAILED=1
  exit 1
fi

echo "$SAY make test's main pytest run is $(id -un)'s; this part runs as $U (uid $(id -u "$U")," \
     "HOME=$HOME_U, TMPDIR=$TMP_U), with no write access to the clone or .venv"
RESULTS=()
record() {  # record NAME STATUS T0: the outcome of a part, timed from T0
  if [ "$2" = 0 ]; then
    RESULTS+=("as $U: $1: passed in $(( $(date +%s) - $3 )) s")
  else
    RESULTS+=("as $U: $1: FAILED (exit $2) after $(( $(date +%s) - $3 )) s")
    FAILED=1
  fi
}
T0=$(date +%s)
echo "$SAY as $U: pytest: ${TESTS[*]}"
status=0
# (on three pytest-xdist workers, a module's tests on one, as make test's root run)
as_user "$REPO/.venv/bin/python" -m pytest -p no:cacheprovider --basetemp="$TMP_U/pytest" -q -n 3 --dist loadfile \
  "${TESTS[@]}" || status=$?
record pytest "$status" "$T0"

# nothing left running: the user's processes get 15 s to end, then are named, killed and fail the run
for _ in $(seq 30); do pgrep -u "$U" >/dev/null || break; sleep 0.5; done
if left=$(pgrep -a -u "$U"); then
  RESULTS+=("as $U: nothing left running: FAILED, killed:"$'\n'"$(cut -c1-200 <<<"$left")")
  pkill -KILL -u "$U" || true
  FAILED=1
else
  RESULTS+=("as $U: nothing left running: passed")
fi

# nothing written outside the user's home (its TMPDIR lies inside); the MPICH shared-memory segments in
# /dev/shm of ranks that ended without MPI_Finalize are counted and removed but fail nothing
roots=(/)
for m in /tmp /var/tmp /run /dev/shm; do mountpoint -q "$m" && roots+=("$m"); done
outside=$(find "${roots[@]}" -xdev \( -path /proc -o -path /sys -o -path "$HOME_U" \) -prune -o -user "$U" -print \
          2>/dev/null | sort -u || true)
shm=$(grep '^/dev/shm/' <<<"$outside" || true)
outside=$(grep -v '^/dev/shm/' <<<"$outside" || true)
if [ -n "$shm" ]; then
  echo "$SAY note: $U left $(wc -l <<<"$shm") shared-memory segment(s) in /dev/shm (MPICH's, left by ranks" \
       "that ended without MPI_Finalize), removed: $(head -3 <<<"$shm" | tr '\n' ' ')..."
  xargs -r rm -f <<<"$shm"
fi
if [ -n "$outside" ]; then
  RESULTS+=("as $U: wrote outside its home: FAILED:"$'\n'"$(head -20 <<<"$outside")")
  FAILED=1
else
  RESULTS+=("as $U: nothing written outside $HOME_U (HOME and TMPDIR): passed")
fi

echo
echo "$SAY make test's main pytest run: as $(id -un)"
printf "$SAY %s\n" "${RESULTS[@]}"
echo "$SAY unprivileged part: $(( $(date +%s) - T0 )) s, $([ "$FAILED" = 0 ] && echo passed || echo FAILED)"
