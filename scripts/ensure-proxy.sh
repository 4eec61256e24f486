#!/usr/bin/env bash
# JupyterHub's proxy, configurable-http-proxy (from the npm registry), for the JupyterHub test
# (tests/integration/test_jupyterhub.py): installed into VENV/node when missing. Node.js and npm come
# from Debian where they are missing and we are root.
set -euo pipefail
dest="${1:-.venv}/node"
[ -x "$dest/node_modules/.bin/configurable-http-proxy" ] && exit 0
if ! command -v npm >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing nodejs and npm (apt-get) for JupyterHub's proxy"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
  else
    echo "npm is missing, and installing it needs root: run 'sudo apt-get install nodejs npm' (or your" \
         "distribution's Node.js), then make install again; only tests/integration/test_jupyterhub.py," \
         "which runs as root only, needs it." >&2
    exit 0
  fi
fi
echo "installing configurable-http-proxy (npm) into $dest"
mkdir -p "$dest"
npm install --prefix "$dest" --no-audit --no-fund --loglevel=error configurable-http-proxy@5 >/dev/null
