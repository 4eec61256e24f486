#!/usr/bin/env bash
# Debian's chromium, for the browser test of the dashboard (tests/integration/test_browser.py, driven by
# Playwright). Installed with apt-get when missing and we are root; the one step of `make install` that
# needs root (docs/installing.md#as-an-unprivileged-user): as another user it says what to run and goes on.
set -euo pipefail
command -v chromium >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing chromium (apt-get) for the browser test"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
elif command -v apt-get >/dev/null; then
  echo "chromium is missing, and installing it needs root: run 'sudo apt-get install chromium';" \
       "tests/integration/test_browser.py fails until /usr/bin/chromium exists (the rest of make install goes on)." >&2
else
  echo "chromium is missing and there is no apt-get here: install your distribution's chromium as" \
       "/usr/bin/chromium; tests/integration/test_browser.py fails until then." >&2
fi
