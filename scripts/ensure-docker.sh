#!/usr/bin/env bash
# Makes a Docker daemon answer on this machine for `make image` and the image tests:
# installs Debian's docker.io (dockerd) and debootstrap (the local base image) when they
# are missing, then starts dockerd in the background when none answers. Debian/Ubuntu
# only; idempotent. dockerd's log: $DOCKERD_LOG (default /var/log/radixkv-dockerd.log).
set -euo pipefail
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/radixkv-dockerd.log}
DEADLINE_S=${DOCKERD_DEADLINE_S:-60}
sudo=""
[[ $(id -u) -eq 0 ]] || sudo="sudo"

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if ((${#missing[@]})); then
  echo "installing system packages: ${missing[*]}"
  if ! command -v apt-get >/dev/null; then
    echo "error: ${missing[*]} missing and apt-get not found; install them by hand" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

docker info >/dev/null 2>&1 && exit 0
dockerd_alive() { ps -C dockerd -o stat= | grep -qv '^Z'; }  # zombies do not count
start_dockerd() {
  echo "starting dockerd (log: $DOCKERD_LOG)"
  # Where an init system runs, let it own the daemon; elsewhere (containers, CI) start it.
  if [[ -d /run/systemd/system ]]; then
    $sudo systemctl start docker
  else
    # A killed dockerd's pid file makes a new one refuse to start while the old pid is
    # still a zombie; no live dockerd is left here, so the file is stale.
    $sudo rm -f /var/run/docker.pid
    $sudo bash -c "nohup dockerd >>'$DOCKERD_LOG' 2>&1 </dev/null &"
  fi
}
last_start=-10
deadline=$((SECONDS + DEADLINE_S))
until docker info >/dev/null 2>&1; do
  # One that is starting gets the time to; one that is gone (or was dying) is replaced.
  if ! dockerd_alive && ((SECONDS - last_start >= 3)); then
    start_dockerd
    last_start=$SECONDS
  fi
  if ((SECONDS >= deadline)); then
    echo "error: dockerd did not answer within ${DEADLINE_S}s; last log lines:" >&2
    tail -n 20 "$DOCKERD_LOG" >&2 || true
    exit 1
  fi
  sleep 0.5
done
echo "dockerd is up ($(docker info --format '{{.ServerVersion}}, {{.Driver}}'))"
