#!/usr/bin/env bash
# The GPU check of radixkv's CUDA path: the ONE script a session with a GPU machine runs,
# through the device tool (docs/gpu.md):
#
#   run  command: "bash scripts/gpu-check.sh"   carry: [".whl"]   timeout_s: 540
#
# (.whl/ comes from scripts/fetch-gpu-wheels.sh, run beforehand where pip works.)
# It needs no network and installs nothing outside /tmp/site:
#   1. prints the machine (GPU, driver, Python, torch, package versions);
#   2. installs the carried wheels whose package is missing or older than required, with
#      --no-deps --no-index --target /tmp/site;
#   3. runs `pytest -m gpu tests/gpu` (bandwidth lines to $OUT/gpu-bench.txt);
#   4. runs the simulator in cuda mode against a daemon, write-through and write-back;
# all within ~8 minutes. Logs go to $OUT (./gpu-out when OUT is unset): gpu-check.log
# (everything printed), gpu-bench.txt, gpu-daemons.log (the pytest daemons' logs),
# daemon-sim.log. Exits 0 only when every step passed; the last line says which failed.
# A rerun can narrow it: GPU_CHECK_TESTS (pytest arguments, default "tests/gpu"),
# GPU_CHECK_SIM=0 (skip step 4), RADIXKV_BW_STRICT=1 (a missed bandwidth target fails).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu-check.log") 2>&1
PY=${PY:-/opt/torch/.venv/bin/python3}
[[ -x $PY ]] || PY=$(command -v python3)
SITE=/tmp/site
PYTEST_BUDGET=${PYTEST_BUDGET:-330}  # seconds for step 3
SIM_BUDGET=${SIM_BUDGET:-60}         # seconds per simulator run in step 4
export PYTHONUNBUFFERED=1
failed=()
step() { echo; echo "=== $* ($(date +%T))"; }

step "1. machine"
nvidia-smi --query-gpu=index,name,pci.bus_id,memory.total,driver_version --format=csv,noheader || true
nvidia-smi topo -m 2>/dev/null | head -5 || true
echo "numa nodes: $(ls -d /sys/devices/system/node/node[0-9]* 2>/dev/null | wc -l)"
echo "python: $PY ($("$PY" -V 2>&1))"
"$PY" - <<'EOF' || failed+=("no CUDA")
import sys
import torch
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, available {torch.cuda.is_available()}, "
      f"devices {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name} {p.total_memory >> 30} GiB "
          f"pci {getattr(p, 'pci_domain_id', '?')}:{getattr(p, 'pci_bus_id', '?')}:{getattr(p, 'pci_device_id', '?')}")
sys.exit(0 if torch.cuda.is_available() else 1)  # without CUDA every GPU test would only skip
EOF

step "2. packages (wheels in .whl/ are installed where the machine's are missing or too old)"
mapfile -t WHEELS < <("$PY" - <<'EOF'
import glob, os, re
from importlib import metadata
from packaging.version import Version
NEED = {"grpcio": "1.85.1", "grpcio-health-checking": "1.85.1", "grpcio-reflection": "1.85.1",
        "protobuf": "7.35.1", "redis": "5", "uvloop": "0.19", "prometheus-client": "0.20",
        "typing-extensions": "4.12"}
wheels = {}
for w in glob.glob(".whl/*.whl"):
    name = re.sub(r"[-_.]+", "-", os.path.basename(w).split("-")[0]).lower()
    wheels[name] = w
for name, need in NEED.items():
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    ok = have is not None and Version(have) >= Version(need)
    action = "ok" if ok else ("install " + os.path.basename(wheels[name]) if name in wheels else "MISSING, no wheel")
    print(f"  {name}: {have or 'absent'} (need >= {need}): {action}", file=__import__('sys').stderr)
    if not ok and name in wheels:
        print(wheels[name])
EOF
)
if ((${#WHEELS[@]})); then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${WHEELS[@]}" \
    || failed+=("wheel install")
fi
export PYTHONPATH=$ROOT/server:$ROOT/client:$SITE${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "
import grpc, google.protobuf, grpc_health, grpc_reflection, redis, uvloop, prometheus_client, torch
import radixkv_server.cli, radixkv_server.server, radixkv.sim.cli
from radixkv.v1 import radixkv_pb2_grpc
print(f'imports ok: grpcio {grpc.__version__}, protobuf {google.protobuf.__version__} ({google.protobuf.__file__})')
" || failed+=("imports")

step "3. pytest -m gpu tests/gpu"
TIMEOUT_OPT=()
"$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT_OPT=(--timeout=300)
export RADIXKV_BENCH_OUT=$OUT/gpu-bench.txt RADIXKV_GPU_DAEMON_LOGS=$OUT/gpu-daemons.log
read -ra TESTS <<<"${GPU_CHECK_TESTS:-tests/gpu}"
timeout -k 10 "$PYTEST_BUDGET" "$PY" -m pytest -m gpu "${TESTS[@]}" -q -s -p no:cacheprovider "${TIMEOUT_OPT[@]}" \
  || failed+=("pytest (rc $?)")
[[ -s $RADIXKV_BENCH_OUT ]] && { echo "--- $RADIXKV_BENCH_OUT"; cat "$RADIXKV_BENCH_OUT"; }

step "4. radixkv-sim --backend cuda against a daemon"
if [[ ${GPU_CHECK_SIM:-1} == 0 ]]; then
  echo "skipped (GPU_CHECK_SIM=0)"
else
  RUN=$(mktemp -d /tmp/rkv-gc-XXXX)
  SOCK=unix://$RUN/radixkv.sock
  DEV=${RADIXKV_TEST_DEVICE:-$(( $("$PY" -c 'import torch; print(torch.cuda.device_count())') - 1 ))}
  "$PY" -m radixkv_server --listen "$SOCK" --metrics-port 0 --host-pool-size 256MiB --log-level info \
    >"$OUT/daemon-sim.log" 2>&1 &
  DAEMON=$!
  for policy in write_through write_back; do
    echo "--- sim $policy on cuda:$DEV"
    timeout -k 5 "$SIM_BUDGET" "$PY" -m radixkv.sim.cli --target "$SOCK" --ready-timeout 60 --backend cuda \
      --device "$DEV" --namespace "gc-$policy" --write-policy "$policy" --workload multiturn --requests 400 \
      --clients 8 --device-pages 256 --host-pages 1024 --layers 8 --heads 2 --head-dim 64 --page-size 16 \
      --dtype bfloat16 --progress-every 200 || failed+=("sim $policy (rc $?)")
  done
  kill -TERM "$DAEMON" 2>/dev/null
  wait "$DAEMON"; rc=$?
  echo "daemon exit code on SIGTERM: $rc"
  ((rc == 0)) || failed+=("sim daemon exit $rc")
  grep -E "host pool: (pinned|unpinned)|error|Traceback" "$OUT/daemon-sim.log" | head -20
  grep -q "host pool: unpinned" "$OUT/daemon-sim.log" || failed+=("sim daemon: no unpin in log")
  rm -rf "$RUN"
fi

echo
if ((${#failed[@]})); then
  echo "GPU CHECK FAILED: ${failed[*]}"
  exit 1
fi
echo "GPU CHECK PASSED"
