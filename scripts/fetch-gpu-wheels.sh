#!/usr/bin/env bash
# Downloads the wheels scripts/gpu-check.sh installs on a GPU machine that has no
# network (Python 3.12, x86-64, manylinux): both pyproject.toml files' runtime dependencies less the
# machine's own torch and numpy (scripts/gpu_packages.py), at the versions installed here.
# Run here, where pip works; the wheels land in .whl/ (git-ignored) and travel with the
# device tool's `carry: [".whl"]`.
#
#   scripts/fetch-gpu-wheels.sh          # PY=python3 by default (.venv's when present)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
# One version of each (two versions of a name in .whl/ stop the whole install there): the
# versions installed here, of every package scripts/gpu_packages.py names (the pyproject.toml files'
# dependencies less the GPU machine's own torch and numpy, and typing-extensions for grpcio).
mapfile -t WHEELS < <("$PY" scripts/gpu_packages.py --pins)
((${#WHEELS[@]})) || { echo "error: scripts/gpu_packages.py named no package" >&2; exit 1; }
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

mkdir -p .whl
for spec in "${WHEELS[@]}"; do
  name=${spec%%==*}
  # A wheel of this name in another version would be a second one: drop it first.
  for old in .whl/"${name//-/_}"-*.whl; do
    [[ -e $old && $old != .whl/"${name//-/_}"-"${spec##*==}"-* ]] && rm -v "$old"
  done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d .whl "$spec" 2> >(grep -v "is ignored: it is neither" >&2)
done

ls -l .whl
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "total: $((total / 1024)) KiB in $(ls .whl/*.whl | wc -l) wheels"
if ((total >= 48 * 1024 * 1024)); then
  echo "error: the wheels take $((total >> 20)) MiB; the device tool carries 64 MiB with the whole tree" >&2
  exit 1
fi
