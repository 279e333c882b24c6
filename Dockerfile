# radixkv daemon image: multi-stage (the builder makes a virtualenv with radixkv
# installed, the runtime stage copies it), non-root, socket directory as a volume.
# `make image` builds it here (scripts/build-image.sh, docs/image.md): from a local
# Debian base where no container registry is reachable, with the host's CA bundle,
# pip index settings and CPU torch wheel staged into scripts/image-extra/. All of
# those reach only the builder stage; the runtime stage copies /opt/radixkv{,-app} alone.
#
# CPU hosts (shared-memory backend; the default), from the public base:
#   docker build -t radixkv:0.2.0 .
# CUDA hosts: a CUDA runtime base image and the matching torch build, e.g.
#   docker build -t radixkv:0.2.0-cu126 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 .
# Build args: BASE_IMAGE; TORCH_INDEX_URL and TORCH_SPEC (torch from an index), or
# TORCH_WHEEL (a wheel file in scripts/image-extra/, e.g. the CPU wheel on disk).
# scripts/image-extra/pip.conf, when present, configures pip in the builder (CA
# bundle, indexes). Any base with python3 >= 3.11 works as is; one without python
# (the CUDA images) gets the distribution's python3 and venv packages from apt.
#
# Run (engine and daemon share /run/radixkv, and the IPC namespace, so /dev/shm, for
# the shm backend; --stop-timeout 50 covers the shutdown grace and storing, docs/image.md):
#   docker run -d --name radixkv --ipc=shareable --shm-size=8g -v radixkv-run:/run/radixkv \
#     --stop-timeout 50 -p 127.0.0.1:9464:9464 radixkv:0.2.0 --host-pool-size 16GiB
#   docker run --ipc=container:radixkv -v radixkv-run:/run/radixkv --user 10001 <engine image>
# CUDA: add --gpus to both, and --pid=container:radixkv to the engine (legacy CUDA IPC
# handles fail to open across PID namespaces).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC="torch>=2.4,<2.14"
ARG TORCH_WHEEL=""
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN if ! python3 -c 'import sys, ensurepip; assert sys.version_info >= (3, 11)' 2>/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
      && rm -rf /var/lib/apt/lists/*; \
    fi
RUN python3 -m venv /opt/radixkv
# Build inputs staged by scripts/build-image.sh (only a README in a plain checkout).
COPY scripts/image-extra/ /tmp/image-extra/
ENV PATH=/opt/radixkv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONFIG_FILE=/tmp/image-extra/pip.conf
# torch first: a staged wheel, or the index matching the base image (CPU or a CUDA version).
# hadolint ignore=DL3013
RUN if [ -n "${TORCH_WHEEL}" ]; then pip install "/tmp/image-extra/${TORCH_WHEEL}"; \
    else pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"; fi
WORKDIR /src
COPY pyproject.toml ./
COPY client/pyproject.toml client/
# The dependencies (from the two pyproject.toml files alone: the daemon's, radixkv-server,
# and its client's, radixkv) in /opt/radixkv, radixkv itself in
# /opt/radixkv-app (on the venv's path through a .pth file): a source change rebuilds
# neither the dependency layer here nor its ~1 GB copy in the runtime stage.
# With the extras a daemon's storage tiers need: zlib-ng (record checksums), hiredis
# (redis-py's C reply parser) and the
# Mooncake Store client (`--storage mooncake://`, non-CUDA wheel; it links libibverbs,
# libcurl and libnuma, installed in the runtime stage).
# hadolint ignore=DL3013
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
c = tomllib.load(open('client/pyproject.toml', 'rb'))['project']; extra = c['optional-dependencies']; \
print(*[d for d in p['dependencies'] if not d.startswith('radixkv')], *c['dependencies'], *extra['buffers'], \
      *extra['routing'], *p['optional-dependencies']['storage'], *p['optional-dependencies']['mooncake'], sep='\n')" \
      >/tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && echo /opt/radixkv-app >"$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/radixkv-app.pth"
COPY README.md LICENSE ./
COPY server/ server/
COPY client/ client/
# hadolint ignore=DL3013
RUN pip install --no-deps --target /opt/radixkv-app ./client . && pip check \
    && python -c "import radixkv_server, radixkv, grpc, torch"

FROM ${BASE_IMAGE} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN if ! python3 -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
    && apt-get update && apt-get install -y --no-install-recommends libibverbs1 libcurl4 libnuma1 libstdc++6 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 radixkv \
    && useradd --system --uid 10001 --gid radixkv --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin radixkv \
    && install -d -o radixkv -g radixkv -m 0750 /run/radixkv
COPY --from=builder /opt/radixkv /opt/radixkv
COPY --from=builder /opt/radixkv-app /opt/radixkv-app
ENV PATH=/opt/radixkv-app/bin:/opt/radixkv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    RADIXKV_LISTEN=unix:///run/radixkv/radixkv.sock \
    RADIXKV_METRICS_HOST=:: \
    RADIXKV_METRICS_PORT=9464 \
    RADIXKV_LOG_FORMAT=json
USER 10001:10001
# The gRPC socket lives here: share it with the engine's container.
VOLUME ["/run/radixkv"]
# Prometheus /metrics. gRPC stays on the unix socket (no TCP port is opened by default).
EXPOSE 9464
# Readiness over the unix socket (gRPC health service "radixkv.v1.RadixKV").
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 CMD ["radixkv-health", "--quiet"]
# SIGTERM: health NOT_SERVING, copies drained, RPCs given --shutdown-grace, exit 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["radixkv-server"]
