#!/usr/bin/env bash
# The JupyterLab extension's one build, for both of its users: setup.py's build_labextension (every wheel)
# and ensure-labextension.sh (make install). TypeScript from labextension/, then JupyterLab's builder
# (webpack), into hvd_notebook/lab/labextension; only when that is missing or older than its sources, else
# quiet. PYTHON is the interpreter whose JupyterLab (or jupyter_builder) runs the builder.
# usage: bash scripts/build-labextension.sh PYTHON [--lenient]
#   --lenient (make install): where npm is missing, install it from Debian as root, else say what to run
#   and exit 0 (JupyterLab runs without the panel). Without it (a wheel), a missing npm is an error: a
#   wheel without its panel is never built.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/npm.sh"
root="$(dirname "$here")"
src="$root/labextension"
out="$root/hvd_notebook/lab/labextension"
python="${1:?usage: build-labextension.sh PYTHON [--lenient]}"
lenient="${2:-}"

# the build is current when its package.json is newer than every source file
if [ -f "$out/package.json" ] && [ -z "$(find "$src/src" "$src/style" "$src/package.json" "$src/package-lock.json" \
    "$src/tsconfig.json" -newer "$out/package.json" -print -quit 2>/dev/null)" ]; then
  exit 0
fi

if [ "$lenient" = --lenient ]; then
  ensure_npm "the JupyterLab extension" "it builds the JupyterLab panel (labextension/); JupyterLab runs \
without it meanwhile." || exit 0  # (everything else works; tests/integration/test_lab_browser.py says what is missing)
elif ! command -v npm >/dev/null 2>&1 || ! command -v node >/dev/null 2>&1; then
  echo "build-labextension.sh: building hvd_notebook's wheel needs Node.js (18 or newer) and npm on PATH, to build" \
       "its JupyterLab panel from labextension/: install them (Debian: 'sudo apt-get install nodejs npm') and" \
       "build again" >&2
  exit 1
fi

echo "building the JupyterLab extension (npm) into hvd_notebook/lab/labextension"
log="$src/build.log"
: >"$log"
fail() {
  cat "$log" >&2
  echo "build-labextension.sh: $1 (the output above, also in $log)" >&2
  exit 1
}
if [ ! -d "$src/node_modules" ] || [ "$src/package-lock.json" -nt "$src/node_modules" ]; then
  (cd "$src" && npm ci --prefer-offline --no-audit --no-fund --loglevel=error) >>"$log" 2>&1 \
    || fail "npm ci failed in labextension/"
  touch "$src/node_modules"
fi
# no half-built output left to look current: the builder writes package.json last
rm -rf "$out"
# as `jupyter labextension build` runs it (JupyterLab 4.6 hands it to jupyter_builder; before, JupyterLab built
# it itself)
builder=jupyter_builder.main
"$python" -c "import jupyter_builder" 2>/dev/null || builder="jupyterlab.labextensions"
"$python" -c "import $builder" 2>/dev/null \
  || fail "$python has neither jupyter_builder nor JupyterLab 4 (pip install 'jupyterlab>=4.2'), whose builder it needs"
(cd "$src" && npm run --silent build:lib && "$python" -m "$builder" build .) >>"$log" 2>&1 \
  || fail "the build failed"
[ -f "$out/package.json" ] || fail "the build wrote no $out/package.json"
rm -f "$log"
