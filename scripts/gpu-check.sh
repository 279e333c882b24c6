#!/usr/bin/env bash
# The GPU check of radixkv's CUDA path, in two passes that fit a 15-minute device budget
# with room to rerun one (docs/gpu.md). Through the device tool:
#
#   run  command: "bash scripts/gpu-check.sh quick"  carry: [".whl"]  timeout_s: 150   (~60 s)
#   run  command: "bash scripts/gpu-check.sh full"   carry: [".whl"]  timeout_s: 420   (~6 min)
#
# (.whl/ comes from scripts/fetch-gpu-wheels.sh, run beforehand where pip works.)
# It needs no network and installs nothing outside /tmp/site. Each pass:
#   1. prints the machine: GPU, driver, Python, torch and CUDA versions, each GPU's UUID
#      and CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM;
#   2. installs the carried wheels whose package is missing or older than required
#      (--no-deps --no-index --target /tmp/site; a rerun on a warm machine skips this);
#   3. quick: pytest tests/gpu/test_cuda_quick.py (environment facts, one IPC open at
#      an offset by UUID, one gather/scatter, one per-layer event wait across processes,
#      the engine's event ordering a store); full: every other test in tests/gpu;
#   4. full only, with GPU_CHECK_SIM=1: the simulator in cuda mode against a daemon
#      (test_cuda_e2e.py already runs it as a process under both policies).
# Every step is bounded: each test by RADIXKV_GPU_TEST_TIMEOUT (s; quick 45, full 120),
# pytest by GPU_CHECK_BUDGET (s; quick 90, full 300) and GPU_CHECK_MAXFAIL failures
# (quick 1, full 2), each sim run by SIM_BUDGET, the sim daemon's exit by 30 s. What a
# stopped run leaves (daemons, engine processes) is killed with its process group.
# Logs go to $OUT (./gpu-out when OUT is unset): gpu-check.log (everything printed),
# gpu-bench.txt (facts and bandwidth lines), gpu-daemons.log (the test daemons' logs),
# daemon-sim.log. Exits 0 only when every step passed; the last line says which failed.
# A rerun can narrow it: GPU_CHECK_TESTS (pytest arguments, replacing the pass's files),
# RADIXKV_BW_STRICT=1 (a missed bandwidth target fails).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PASS=${1:-quick}
case $PASS in
  quick) DEF_TESTS="tests/gpu/test_cuda_quick.py"; DEF_BUDGET=90; DEF_TEST_TIMEOUT=45; DEF_MAXFAIL=1 ;;
  full) DEF_TESTS="tests/gpu --ignore=tests/gpu/test_cuda_quick.py"; DEF_BUDGET=300; DEF_TEST_TIMEOUT=120
        DEF_MAXFAIL=2 ;;
  *) echo "usage: $0 [quick|full]" >&2; exit 2 ;;
esac
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu-check.log") 2>&1
PY=${PY:-/opt/torch/.venv/bin/python3}
[[ -x $PY ]] || PY=$(command -v python3)
SITE=/tmp/site
export PYTHONPATH=$ROOT/server:$ROOT/client:$ROOT/tests/gpu:$SITE${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export RADIXKV_GPU_TEST_TIMEOUT=${RADIXKV_GPU_TEST_TIMEOUT:-$DEF_TEST_TIMEOUT}
BUDGET=${GPU_CHECK_BUDGET:-$DEF_BUDGET}
MAXFAIL=${GPU_CHECK_MAXFAIL:-$DEF_MAXFAIL}
SIM_BUDGET=${SIM_BUDGET:-45}
failed=()
step() { echo; echo "=== $PASS: $* ($(date +%T))"; }

step "1. machine"
timeout 20 nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,memory.total,memory.used,driver_version \
  --format=csv,noheader || true
echo "numa nodes: $(ls -d /sys/devices/system/node/node[0-9]* 2>/dev/null | wc -l)"
echo "python: $PY ($("$PY" -V 2>&1))"
timeout 60 "$PY" - <<'EOF' || failed+=("no CUDA")
import sys
import torch
print(f"torch {torch.__version__}, cuda runtime {torch.version.cuda}, available {torch.cuda.is_available()}, "
      f"devices {torch.cuda.device_count()}")
try:
    from radixkv_server.datapath.cuda_host import can_use_host_pointer
except Exception as e:  # the packages of step 2 may be missing still
    print(f"  (host-pointer attribute not read: {e})")
    can_use_host_pointer = lambda i: "?"
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name} {p.total_memory >> 30} GiB uuid GPU-{p.uuid} "
          f"CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM={can_use_host_pointer(i)}")
sys.exit(0 if torch.cuda.is_available() else 1)  # without CUDA every GPU test would only skip
EOF

step "2. packages (wheels in .whl/ are installed where the machine's are missing or too old)"
mapfile -t WHEELS < <(timeout 60 "$PY" - <<'EOF'
import glob, os, re, sys
from importlib import metadata
from packaging.version import Version
sys.path.insert(0, "scripts")
from gpu_packages import minimums  # both pyproject.toml files' dependencies, less the machine's torch and numpy
NEED = minimums()
wheels = {}
for w in glob.glob(".whl/*.whl"):
    name = re.sub(r"[-_.]+", "-", os.path.basename(w).split("-")[0]).lower()
    wheels[name] = w
for name, need in NEED.items():
    try:
        have = metadata.version(name)  # /tmp/site is on the path: a rerun finds what it installed
    except metadata.PackageNotFoundError:
        have = None
    ok = have is not None and Version(have) >= Version(need)
    action = "ok" if ok else ("install " + os.path.basename(wheels[name]) if name in wheels else "MISSING, no wheel")
    print(f"  {name}: {have or 'absent'} (need >= {need}): {action}", file=sys.stderr)
    if not ok and name in wheels:
        print(wheels[name])
EOF
)
if ((${#WHEELS[@]})); then
  timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "${WHEELS[@]}" || failed+=("wheel install")
fi
timeout 60 "$PY" -c "
import grpc, google.protobuf, grpc_health, grpc_reflection, redis, uvloop, prometheus_client, torch, msgspec, zmq
import radixkv_server.cli, radixkv_server.server, radixkv.sim.cli
from radixkv.v1 import radixkv_pb2_grpc
print(f'imports ok: grpcio {grpc.__version__}, protobuf {google.protobuf.__version__} ({google.protobuf.__file__})')
" || failed+=("imports")

step "3. pytest ($BUDGET s, $RADIXKV_GPU_TEST_TIMEOUT s per test, --maxfail=$MAXFAIL)"
export RADIXKV_BENCH_OUT=$OUT/gpu-bench.txt RADIXKV_GPU_DAEMON_LOGS=$OUT/gpu-daemons.log
read -ra TESTS <<<"${GPU_CHECK_TESTS:-$DEF_TESTS}"
# Its own process group (setsid), so what a stopped run leaves behind can be killed.
setsid timeout -k 10 "$BUDGET" "$PY" -m pytest -m gpu "${TESTS[@]}" -q -s -p no:cacheprovider \
  --maxfail="$MAXFAIL" &
PYTEST=$!
wait "$PYTEST"; rc=$?
kill -KILL -- "-$PYTEST" 2>/dev/null && echo "(killed what the pytest run left)"
((rc == 0)) || failed+=("pytest (rc $rc$( ((rc == 124)) && echo ", over its $BUDGET s budget"))")
[[ -s $RADIXKV_BENCH_OUT ]] && { echo "--- $RADIXKV_BENCH_OUT"; cat "$RADIXKV_BENCH_OUT"; }

if [[ $PASS == full && ${GPU_CHECK_SIM:-0} == 1 ]]; then
  step "4. radixkv-sim --backend cuda against a daemon"
  RUN=$(mktemp -d /tmp/rkv-gc-XXXX)
  SOCK=unix://$RUN/radixkv.sock
  DEV=${RADIXKV_TEST_DEVICE:-$(( $(timeout 60 "$PY" -c 'import torch; print(torch.cuda.device_count())') - 1 ))}
  "$PY" -m radixkv_server --listen "$SOCK" --metrics-port 0 --host-pool-size 256MiB --log-level info \
    >"$OUT/daemon-sim.log" 2>&1 &
  DAEMON=$!
  for policy in write_through write_back; do
    echo "--- sim $policy on cuda:$DEV"
    timeout -k 5 "$SIM_BUDGET" "$PY" -m radixkv.sim.cli --target "$SOCK" --ready-timeout 30 --backend cuda \
      --device "$DEV" --namespace "gc-$policy" --write-policy "$policy" --workload multiturn --requests 400 \
      --clients 8 --device-pages 256 --host-pages 1024 --layers 8 --heads 2 --head-dim 64 --page-size 16 \
      --dtype bfloat16 --progress-every 200 || failed+=("sim $policy (rc $?)")
  done
  kill -TERM "$DAEMON" 2>/dev/null
  for _ in $(seq 60); do kill -0 "$DAEMON" 2>/dev/null || break; sleep 0.5; done  # at most 30 s
  if kill -0 "$DAEMON" 2>/dev/null; then
    kill -KILL "$DAEMON"; failed+=("sim daemon did not stop within 30 s of SIGTERM")
  fi
  wait "$DAEMON"; rc=$?
  echo "daemon exit code on SIGTERM: $rc"
  ((rc == 0)) || failed+=("sim daemon exit $rc")
  grep -E "host pool: (pinned|unpinned|pinning)|error|Traceback" "$OUT/daemon-sim.log" | head -20
  grep -q "host pool: unpinned" "$OUT/daemon-sim.log" || failed+=("sim daemon: no unpin in log")
  rm -rf "$RUN"
fi

echo
if ((${#failed[@]})); then
  echo "GPU CHECK ($PASS) FAILED: ${failed[*]}"
  exit 1
fi
echo "GPU CHECK ($PASS) PASSED"
