#!/usr/bin/env bash
# Installs the system programs the test suite drives for real: redis-server (L3 storage
# tests) and prometheus + promtool (metrics tests). Debian/Ubuntu only; idempotent.
set -euo pipefail
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v prometheus >/dev/null && command -v promtool >/dev/null || missing+=(prometheus)
# The Mooncake Store client (`mooncake` extra) links libibverbs even when it runs over TCP.
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || missing+=(libibverbs1)
((${#missing[@]})) || exit 0
echo "installing system packages: ${missing[*]}"
sudo=""
[[ $(id -u) -eq 0 ]] || sudo="sudo"
if ! command -v apt-get >/dev/null; then
  echo "error: ${missing[*]} missing and apt-get not found; install them by hand" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# Debian's packages start services on install where an init system runs; tests start
# their own instances on temporary sockets and ports, so the system ones are not needed.
