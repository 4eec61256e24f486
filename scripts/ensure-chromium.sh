#!/usr/bin/env bash
# Debian's chromium, for the browser test of the dashboard (tests/test_browser.py,
# driven by Playwright). Installed with apt-get when missing and we are root.
set -euo pipefail
command -v chromium >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing chromium (apt-get) for the browser test"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
else
  echo "chromium is missing and cannot be installed here (not root or no apt-get);" \
       "tests/test_browser.py will fail until /usr/bin/chromium exists." >&2
fi
