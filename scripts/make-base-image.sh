#!/usr/bin/env bash
# Makes the local Debian base image the Dockerfile builds FROM where no container
# registry is reachable: `debootstrap --variant=minbase` from the Debian package
# registry, plus python3 (3.11 on bookworm) and its venv module, then `docker import`.
# It stands in for python:3.11-slim-bookworm (same Debian release and Python minor).
# Skips the work when the image already exists (pass --force to rebuild).
# Usage: scripts/make-base-image.sh [--force]   (env: BASE_IMAGE, SUITE, DEBIAN_MIRROR)
set -euo pipefail
SUITE=${SUITE:-bookworm}
BASE_IMAGE=${BASE_IMAGE:-radixkv-base:$SUITE}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
sudo=""
[[ $(id -u) -eq 0 ]] || sudo="sudo"

if [[ ${1:-} != --force ]] && docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  echo "base image $BASE_IMAGE exists (scripts/make-base-image.sh --force rebuilds it)"
  exit 0
fi
rootfs=$(mktemp -d /var/tmp/radixkv-rootfs.XXXXXX)
trap '$sudo rm -rf "$rootfs"' EXIT
echo "debootstrap $SUITE into $rootfs (about a minute)"
start=$SECONDS
$sudo debootstrap --variant=minbase --include=python3,python3-venv \
  "$SUITE" "$rootfs" "$DEBIAN_MIRROR" >"$rootfs.log" 2>&1 || {
  tail -n 30 "$rootfs.log" >&2; exit 1; }
rm -f "$rootfs.log"
# What the official slim images leave out too: apt lists, caches, docs, man pages.
$sudo rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
  "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* \
  "$rootfs"/usr/share/info/* "$rootfs"/var/log/*.log
$sudo tar -C "$rootfs" --numeric-owner -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["bash"]' \
  --message "debootstrap --variant=minbase $SUITE + python3 python3-venv" \
  - "$BASE_IMAGE" >/dev/null
echo "base image $BASE_IMAGE made in $((SECONDS - start))s:" \
  "$(docker run --rm "$BASE_IMAGE" python3 --version)," \
  "$(docker image inspect -f '{{.Size}}' "$BASE_IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
