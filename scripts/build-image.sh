#!/usr/bin/env bash
# Builds the radixkv image on this machine (`make image`): a Docker daemon (installed
# and started when missing), the local base image (made once, then reused), the build
# inputs this machine's pip needs staged into scripts/image-extra/, then the classic
# builder (the CLI's BuildKit needs buildx, which is not installed here).
# Env: IMAGE (default radixkv:<version>), BASE_IMAGE (default the local
# radixkv-base:bookworm; python:3.11-slim-bookworm and CUDA bases work where a registry
# is reachable), TORCH_INDEX_URL (torch from that index instead of the local CPU wheel),
# TORCH_SPEC, CA_BUNDLE (default: pip's cert setting, else the system bundle).
# Prints the build's wall time and the image's size.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV_PY=${VENV_PY:-.venv/bin/python}  # whose pip settings and torch version the build follows
[[ -x $VENV_PY ]] || VENV_PY=$PY
VERSION=$("$PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
IMAGE=${IMAGE:-radixkv:$VERSION}
BASE_IMAGE=${BASE_IMAGE:-radixkv-base:bookworm}
EXTRA=scripts/image-extra
start=$SECONDS

scripts/ensure-docker.sh
if [[ $BASE_IMAGE == radixkv-base:* ]]; then
  BASE_IMAGE=$BASE_IMAGE SUITE=${BASE_IMAGE#radixkv-base:} scripts/make-base-image.sh
fi

# pip settings for the builder: the CA bundle and the host's http(s) indexes. Local
# (file://) indexes and find-links folders do not exist inside the build; the torch
# wheel they hold is staged below instead.
pip_setting() {  # pip_setting KEY: the value pip uses on this host (its precedence), or empty
  { "$VENV_PY" -m pip config list 2>/dev/null || true; } | "$PY" -c '
import sys
key, found = sys.argv[1], {}
for line in sys.stdin:
    name, _, value = line.rstrip("\n").partition("=")
    scope, _, k = name.rpartition(".")
    if k == key:
        found[scope] = value.strip("\x27")
print(next((found[s] for s in (":env:", "site", "user", "global") if found.get(s)), ""))
' "$1"
}
CA_BUNDLE=${CA_BUNDLE:-$(pip_setting cert)}
[[ -n $CA_BUNDLE ]] || CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
conf=$(mktemp)
trap 'rm -f "$conf"' EXIT
echo "[global]" >"$conf"
if [[ -f $CA_BUNDLE ]]; then
  cmp -s "$CA_BUNDLE" "$EXTRA/ca.crt" || cp "$CA_BUNDLE" "$EXTRA/ca.crt"
  echo "cert = /tmp/image-extra/ca.crt" >>"$conf"
else
  rm -f "$EXTRA/ca.crt"
fi
for key in index-url extra-index-url; do
  urls=$(tr ' ' '\n' <<<"$(pip_setting $key)" | grep -E '^https?://' | tr '\n' ' ' || true)
  [[ -z ${urls// /} ]] || echo "$key = ${urls% }" >>"$conf"
done
cmp -s "$conf" "$EXTRA/pip.conf" || cp "$conf" "$EXTRA/pip.conf"

# torch: the host's CPU wheel when pip finds it locally for the base's Python, else
# TORCH_INDEX_URL (the Dockerfile's default: the CPU index).
build_args=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
[[ -z ${TORCH_SPEC:-} ]] || build_args+=(--build-arg "TORCH_SPEC=$TORCH_SPEC")
wheel=""
if [[ -n ${TORCH_INDEX_URL:-} ]]; then
  build_args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
else
  torch_version=${TORCH_VERSION:-$("$VENV_PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)}
  # The base's Python picks the wheel (a base without python3 gets none: the index then).
  pyver=$(docker run --rm --entrypoint python3 "$BASE_IMAGE" -c 'import sys; print("%d%d" % sys.version_info[:2])' \
    2>/dev/null || true)
  if [[ $torch_version == *+cpu && -n $pyver ]]; then
    wheel=$(cd "$EXTRA" && ls "torch-$torch_version-cp$pyver-"*.whl 2>/dev/null | head -n1 || true)
    if [[ -z $wheel ]] && "$VENV_PY" -m pip download -q --no-index --no-deps --only-binary=:all: \
        --python-version "$pyver" -d "$EXTRA" "torch==$torch_version" 2>/dev/null; then
      wheel=$(cd "$EXTRA" && ls "torch-$torch_version-cp$pyver-"*.whl | head -n1)
    fi
  fi
  [[ -z $wheel ]] || build_args+=(--build-arg "TORCH_WHEEL=$wheel")
fi
# Stale wheels would only slow the context upload.
find "$EXTRA" -maxdepth 1 -name '*.whl' ! -name "${wheel:-none}" -delete
echo "building $IMAGE from $BASE_IMAGE (torch: ${wheel:-${TORCH_INDEX_URL:-the Dockerfile default index}})"

build_start=$SECONDS
previous=$(docker image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)
mkdir -p build
log=build/image-build.log
if ! DOCKER_BUILDKIT=0 docker build -t "$IMAGE" "${build_args[@]}" \
    --label "org.opencontainers.image.version=$VERSION" . >"$log" 2>&1; then
  tail -n 40 "$log" >&2
  echo "error: docker build failed; full log: $log" >&2
  exit 1
fi
# The image this one replaces would stay behind untagged, with the layers only it uses.
if [[ -n $previous && $previous != $(docker image inspect -f '{{.Id}}' "$IMAGE") ]]; then
  docker image rm "$previous" >/dev/null 2>&1 || true
fi
size=$(docker image inspect -f '{{.Size}}' "$IMAGE")
echo "built $IMAGE: $(awk -v s="$size" 'BEGIN {printf "%.0f MB", s / 1e6}'),"\
  "docker build $((SECONDS - build_start))s, make image $((SECONDS - start))s"
