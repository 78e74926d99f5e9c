#!/usr/bin/env bash
# Installs, when missing, the Debian packages the tests drive: chromium for the browser tests of
# `ckstore ui` (tests/ui; Playwright drives it through executable_path, as its own browser
# download cannot work without network access), and zsh and fish, whose completion scripts
# tests/cli parses. Idempotent; as non-root it only warns, and those tests then skip (or fail,
# under CI=1, which must run them).
set -uo pipefail
missing=()
for pkg in chromium zsh fish; do
  command -v "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
[ "${#missing[@]}" = 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null && exit 0
fi
echo "warning: ${missing[*]} not installed and could not be installed here (their tests" \
     "will skip; as root: apt-get install ${missing[*]})" >&2
exit 0
