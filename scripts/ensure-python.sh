#!/usr/bin/env bash
# Create the virtual environment at $1 with a Python >= 3.11, installing
# Debian's venv support first when the system Python lacks it.
set -euo pipefail
venv=${1:-.venv}
[ -x "$venv/bin/python" ] && exit 0
py=""
for cand in python3.13 python3.12 python3.11 python3; do
  if command -v "$cand" >/dev/null 2>&1 &&
     "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    py=$cand; break
  fi
done
if [ -z "$py" ]; then
  echo "hvd_notebook needs Python 3.11 or newer: install it as root ('sudo apt-get install python3 python3-venv')," \
       "or put a Python >= 3.11 of your own (pyenv, conda) first on PATH; then run make install again." >&2
  exit 1
fi
if ! "$py" -m venv "$venv" 2>/dev/null; then
  rm -rf "$venv"
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
    "$py" -m venv "$venv"
  else
    echo "'$py -m venv' failed: its venv module is missing, and installing it needs root: run" \
         "'sudo apt-get install python3-venv' (your distribution's venv package), then make install again." >&2
    exit 1
  fi
fi
