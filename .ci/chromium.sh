#!/usr/bin/env bash
# Make Debian's chromium available for the dashboard's browser test: install it when it is
# missing and this is root with apt-get; otherwise say why (the test then skips).
set -euo pipefail
if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "chromium is not installed and cannot be installed here (needs root and apt-get)" >&2
    exit 1
fi
apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
