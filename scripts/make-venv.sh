#!/usr/bin/env bash
# make-venv.sh PY VENV: the project's virtualenv, made with PY, which must be Python 3.11 or
# newer (checked before anything is downloaded). A venv left half-made (Debian's python3
# without its venv package makes one with no pip) is removed and made again, and a failed
# one says what to install.
set -euo pipefail
py=$1 venv=$2
if ! command -v "$py" >/dev/null; then
  echo "radixkv needs Python 3.11 or newer: $py is not installed; run make PY=python3.11 ..." >&2
  exit 1
fi
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "radixkv needs Python 3.11 or newer; $py is $("$py" -V 2>&1): run make PY=python3.11 ..." >&2
  exit 1
fi
rm -rf "$venv"
if ! "$py" -m venv "$venv"; then
  rm -rf "$venv"
  echo "$py could not make a virtualenv: install its venv package (Debian/Ubuntu: apt-get install python3-venv," >&2
  echo "or python3.11-venv for that interpreter), then run make again" >&2
  exit 1
fi
