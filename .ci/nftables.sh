#!/usr/bin/env bash
# Make Debian's nftables available for the NAT lab's tests (tests/integration/test_nat.py): install
# it when it is missing and this is root with apt-get; otherwise say why (those tests then skip).
set -euo pipefail
if command -v nft >/dev/null || [ -x /usr/sbin/nft ]; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "nft is not installed and cannot be installed here (needs root and apt-get)" >&2
    exit 1
fi
apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables >/dev/null
