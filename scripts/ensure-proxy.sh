#!/usr/bin/env bash
# JupyterHub's proxy, configurable-http-proxy (from the npm registry), for the JupyterHub test
# (tests/integration/test_jupyterhub.py): installed into VENV/node when missing. Node.js and npm come
# from Debian where they are missing and we are root.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/npm.sh"
dest="${1:-.venv}/node"
[ -x "$dest/node_modules/.bin/configurable-http-proxy" ] && exit 0
ensure_npm "JupyterHub's proxy" "only tests/integration/test_jupyterhub.py, which runs as root only, needs \
it." || exit 0
echo "installing configurable-http-proxy (npm) into $dest"
mkdir -p "$dest"
npm install --prefix "$dest" --no-audit --no-fund --loglevel=error configurable-http-proxy@5 >/dev/null
