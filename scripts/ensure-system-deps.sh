#!/usr/bin/env bash
# Installs the system programs the test suite drives for real: redis-server (L3 storage
# tests), valkey-server (the same cluster tests against Valkey) and prometheus + promtool
# (metrics tests). Debian/Ubuntu only; idempotent.
set -euo pipefail
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v prometheus >/dev/null && command -v promtool >/dev/null || missing+=(prometheus)
# The Mooncake Store client (`mooncake` extra) links libibverbs even when it runs over TCP.
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || missing+=(libibverbs1)
need_valkey=0
command -v valkey-server >/dev/null && command -v valkey-cli >/dev/null || need_valkey=1
((${#missing[@]} || need_valkey)) || exit 0
sudo=""
[[ $(id -u) -eq 0 ]] || sudo="sudo"
if ! command -v apt-get >/dev/null; then
  echo "error: ${missing[*]} $( ((need_valkey)) && echo valkey-server) missing and apt-get not found; install them by hand" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
if ((${#missing[@]})); then
  echo "installing system packages: ${missing[*]}"
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if ((need_valkey)); then
  # Valkey is in Debian from trixie on; bookworm has it in bookworm-backports only.
  release=()
  if ! apt-cache show valkey-server >/dev/null 2>&1; then
    codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
    if [[ $codename != bookworm ]]; then
      echo "error: no valkey-server package for ${codename:-this release}; install Valkey by hand" >&2
      exit 1
    fi
    echo "deb http://deb.debian.org/debian bookworm-backports main" |
      $sudo tee /etc/apt/sources.list.d/radixkv-bookworm-backports.list >/dev/null
    $sudo apt-get update -qq
    release=(-t bookworm-backports)
  fi
  echo "installing system packages: valkey-server ${release[*]}"
  $sudo apt-get install -y -qq --no-install-recommends "${release[@]}" valkey-server >/dev/null
fi
# Debian's packages start services on install where an init system runs; tests start
# their own instances on temporary sockets and ports, so the system ones are not needed.
