#!/usr/bin/env bash
# Installs Debian's chromium for the browser tests of `ckstore ui` (tests/ui), when missing.
# Playwright drives it through executable_path: Playwright's own browser download cannot
# work without network access. Idempotent; as non-root it only warns, and the browser tests
# then skip (or fail, under CI=1, which must run them).
set -uo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null && exit 0
fi
echo "warning: chromium is not installed and could not be installed here (the browser" \
     "tests of ckstore ui will skip; as root: apt-get install chromium)" >&2
exit 0
