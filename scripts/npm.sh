# Sourced by the scripts that install from the npm registry (ensure-proxy.sh, build-labextension.sh).
# ensure_npm FOR WHAT: npm on PATH, with Node.js and npm from Debian where they are missing and we are root;
# else says what to run (FOR: what needs it, WHAT: what goes without it) and returns 1.
ensure_npm() {
  command -v npm >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing nodejs and npm (apt-get) for $1"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
    return
  fi
  echo "npm is missing, and installing it needs root: run 'sudo apt-get install nodejs npm' (or your" \
       "distribution's Node.js, 18 or newer), then make install again; $2" >&2
  return 1
}
