#!/usr/bin/env bash
# Starts the daemon image as the Dockerfile documents (`make image-run`) and waits, up to
# $HEALTHY_TIMEOUT_S, for its HEALTHCHECK to report healthy; prints how to reach it.
# Env: IMAGE (default radixkv:<version>), NAME (container and volume prefix, default
# radixkv), METRICS_PORT (host loopback port for /metrics, default 9464), ARGS (daemon
# flags, default --host-pool-size 1GiB). Replaces a container of the same name.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
IMAGE=${IMAGE:-radixkv:$VERSION}
NAME=${NAME:-radixkv}
METRICS_PORT=${METRICS_PORT:-9464}
HEALTHY_TIMEOUT_S=${HEALTHY_TIMEOUT_S:-90}
read -r -a flags <<<"${ARGS:---host-pool-size 1GiB}"

docker rm -f "$NAME" >/dev/null 2>&1 || true
docker run -d --name "$NAME" --ipc=shareable --shm-size=2g -v "$NAME-run:/run/radixkv" --stop-timeout 50 \
  -p "127.0.0.1:$METRICS_PORT:9464" "$IMAGE" "${flags[@]}" >/dev/null
deadline=$((SECONDS + HEALTHY_TIMEOUT_S))
until [[ $(docker inspect -f '{{.State.Health.Status}}' "$NAME") == healthy ]]; do
  if [[ $(docker inspect -f '{{.State.Running}}' "$NAME") != true ]] || ((SECONDS >= deadline)); then
    echo "error: $NAME did not turn healthy; its log:" >&2
    docker logs --tail 30 "$NAME" >&2
    exit 1
  fi
  sleep 1
done
echo "$NAME is healthy: metrics http://127.0.0.1:$METRICS_PORT/metrics, socket volume $NAME-run"
echo "engine: docker run --ipc=container:$NAME -v $NAME-run:/run/radixkv --user 10001 <engine image>"
echo "stop:   docker stop $NAME"
