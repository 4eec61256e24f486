#!/usr/bin/env bash
# hvd_notebook's JupyterLab extension (the clusters panel and status-bar item, labextension/): built with npm
# into hvd_notebook/lab/labextension when that is missing or older than its sources, then linked into VENV's
# share/jupyter/labextensions so that VENV's JupyterLab loads it; and its server side (hvd_notebook.lab)
# enabled in VENV (an editable install does not install the package's data files). Quiet when nothing
# changed. Node.js and npm come from Debian where they are missing and we are root.
# usage (from the repository's root): bash scripts/ensure-labextension.sh [VENV]   (default .venv)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/npm.sh"
root="$(pwd)"
src="$root/labextension"
out="$root/hvd_notebook/lab/labextension"
venv_arg="${1:-.venv}"
if [ ! -d "$venv_arg" ]; then
  echo "ensure-labextension.sh: no virtual environment at $venv_arg (run it from the repository's root," \
       "after scripts/ensure-python.sh)" >&2
  exit 1
fi
venv="$(cd "$venv_arg" && pwd)"
if [ ! -f "$src/package.json" ]; then
  echo "ensure-labextension.sh: $src/package.json is missing (run it from the repository's root)" >&2
  exit 1
fi

# the build is current when its package.json is newer than every source file
stale=yes
if [ -f "$out/package.json" ] && [ -z "$(find "$src/src" "$src/style" "$src/package.json" "$src/package-lock.json" \
    "$src/tsconfig.json" -newer "$out/package.json" -print -quit 2>/dev/null)" ]; then
  stale=no
fi

if [ "$stale" = yes ]; then
  if ! ensure_npm "the JupyterLab extension" "it builds the JupyterLab panel (labextension/); JupyterLab runs \
without it meanwhile."; then
    exit 0  # (everything else works; tests/integration/test_lab_browser.py says what is missing)
  fi
  echo "building the JupyterLab extension (npm) into hvd_notebook/lab/labextension"
  log="$src/build.log"
  : >"$log"
  if [ ! -d "$src/node_modules" ] || [ "$src/package-lock.json" -nt "$src/node_modules" ]; then
    if ! (cd "$src" && npm ci --no-audit --no-fund --loglevel=error) >>"$log" 2>&1; then
      cat "$log" >&2
      echo "ensure-labextension.sh: npm ci failed in labextension/ (the output above, also in $log)" >&2
      exit 1
    fi
    touch "$src/node_modules"
  fi
  # no half-built output left to look current: the builder writes package.json last
  rm -rf "$out"
  # TypeScript, then JupyterLab's builder (webpack), as `jupyter labextension build` runs it (JupyterLab 4.6
  # hands it to jupyter_builder; before, JupyterLab built it itself)
  builder=jupyter_builder.main
  "$venv/bin/python" -c "import jupyter_builder" 2>/dev/null || builder="jupyterlab.labextensions"
  if ! (cd "$src" && npm run --silent build:lib && "$venv/bin/python" -m "$builder" build .) \
      >>"$log" 2>&1; then
    cat "$log" >&2
    echo "ensure-labextension.sh: the build failed (the output above, also in $log)" >&2
    exit 1
  fi
  if [ ! -f "$out/package.json" ]; then
    cat "$log" >&2
    echo "ensure-labextension.sh: the build wrote no $out/package.json" >&2
    exit 1
  fi
  rm -f "$log"
fi

# VENV's JupyterLab finds it in share/jupyter/labextensions (a link, so that a rebuild needs no reinstall)
dest="$venv/share/jupyter/labextensions/hvd-notebook-lab"
if [ "$(readlink "$dest" 2>/dev/null || true)" != "$out" ]; then
  mkdir -p "$(dirname "$dest")"
  rm -rf "$dest"
  ln -s "$out" "$dest"
fi

# the server extension, enabled for VENV's Jupyter Server (as a wheel's data files would)
config="$venv/etc/jupyter/jupyter_server_config.d/hvd_notebook.json"
if ! cmp -s "$root/jupyter-config/jupyter_server_config.d/hvd_notebook.json" "$config"; then
  mkdir -p "$(dirname "$config")"
  cp "$root/jupyter-config/jupyter_server_config.d/hvd_notebook.json" "$config"
fi
