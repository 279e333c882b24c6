"""The two distributions: `radixkv`, the client engines install (client/pyproject.toml),
and `radixkv-server`, the daemon (pyproject.toml). An engine depending on the client got
the whole daemon, CUDA torch and all (~2.8 GB); the client now needs gRPC alone, and the
two say one version."""

import os
import subprocess
import sys
import tomllib

from opstools import REPO

SERVER = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
CLIENT = tomllib.loads((REPO / "client" / "pyproject.toml").read_text())["project"]
# What the client's core must not need: the daemon's dependencies and the extras' own.
NOT_NEEDED = ("torch", "numpy", "zmq", "msgspec", "uvloop", "redis", "prometheus_client", "grpc_reflection",
              "radixkv_server", "vllm")


def test_the_client_and_the_daemon_say_one_version():
    assert (CLIENT["name"], SERVER["name"]) == ("radixkv", "radixkv-server")
    assert CLIENT["version"] == SERVER["version"]
    [pin] = [d for d in SERVER["dependencies"] if d.startswith("radixkv")]
    assert pin.endswith(f"=={CLIENT['version']}"), "the daemon needs its own client's version"


def test_the_client_needs_grpc_alone():
    names = {d.split(">")[0].split("=")[0].split("[")[0] for d in CLIENT["dependencies"]}
    assert names == {"grpcio", "grpcio-health-checking", "protobuf"}


def test_the_client_calls_a_daemon_with_none_of_the_daemons_dependencies_importable(module_daemon):
    """As in an engine's environment with `pip install radixkv` alone: every module
    NOT_NEEDED is hidden as Python hides a missing one (None in sys.modules)."""
    script = f"""
import sys
for name in {NOT_NEEDED!r}:
    sys.modules[name] = None
import radixkv, radixkv.vllm
from radixkv import Client
with Client({module_daemon.target!r}, timeout=10) as kv:
    kv.wait_ready(10)
    print(radixkv.__version__, kv.stats().version, kv.check_invariants())
"""
    env = {**os.environ, "PYTHONPATH": str(REPO / "client")}  # the client's tree alone, not the daemon's
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [CLIENT["version"], CLIENT["version"], "[]"]
