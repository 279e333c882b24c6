"""Helpers of the operability tests: where the repository and the venv's tools are, and
running the real tools. The daemon and the bounded waits are tests/support/daemon.py."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's bin: grpcurl, hadolint, radixkv-health


def run_tool(args: list[str], env: dict | None = None, timeout: float = 30.0, check: bool = True,
             **kwargs) -> subprocess.CompletedProcess:
    """Run a program; with `check`, fail the test (showing its output) unless it exits 0."""
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, **kwargs)
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}",
                    pytrace=False)
    return done
