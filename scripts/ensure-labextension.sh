#!/usr/bin/env bash
# hvd_notebook's JupyterLab extension (the clusters panel and status-bar item, labextension/) for a development
# install (make install): built by build-labextension.sh (the wheel's own build step) when that is missing or
# older than its sources, then linked into VENV's share/jupyter/labextensions so that VENV's JupyterLab loads
# it and a rebuild needs no reinstall; and its server side (hvd_notebook.lab) enabled in VENV. Quiet when
# nothing changed. Node.js and npm come from Debian where they are missing and we are root. A deployment
# installs the wheel instead, which holds both (docs/jupyterhub.md).
# usage (from the repository's root): bash scripts/ensure-labextension.sh [VENV]   (default .venv)
set -euo pipefail
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

bash "$(dirname "${BASH_SOURCE[0]}")/build-labextension.sh" "$venv/bin/python" --lenient
[ -f "$out/package.json" ] || exit 0  # (no npm: build-labextension.sh said what to run)

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
