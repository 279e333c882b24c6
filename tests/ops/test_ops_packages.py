"""The two distributions: `radixkv`, the client engines install (client/pyproject.toml),
and `radixkv-server`, the daemon (pyproject.toml). An engine depending on the client got
the whole daemon, CUDA torch and all (~2.8 GB); the client now needs gRPC alone, and the
two say one version. Its generated code runs on the oldest gRPC and protobuf it declares."""

import os
import shutil
import subprocess
import sys
import tomllib

import pytest

from opstools import REPO

SERVER = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
CLIENT = tomllib.loads((REPO / "client" / "pyproject.toml").read_text())["project"]


def test_the_client_and_the_daemon_say_one_version():
    assert (CLIENT["name"], SERVER["name"]) == ("radixkv", "radixkv-server")
    assert CLIENT["version"] == SERVER["version"]
    [pin] = [d for d in SERVER["dependencies"] if d.startswith("radixkv")]
    assert pin.endswith(f"=={CLIENT['version']}"), "the daemon needs its own client's version"


def test_the_client_needs_grpc_alone():
    names = {d.split(">")[0].split("=")[0].split("[")[0] for d in CLIENT["dependencies"]}
    assert names == {"grpcio", "grpcio-health-checking", "grpcio-status", "googleapis-common-protos", "protobuf"}


# The oldest runtimes client/pyproject.toml declares: its generated code must run on them.
FLOORS = ("grpcio==1.66.2", "grpcio-health-checking==1.66.2", "grpcio-status==1.66.2",
          "googleapis-common-protos==1.63.2", "protobuf==5.27.2")


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="grpcio 1.66.2, the client's floor, has no wheel for "
                    "Python 3.14: its floor there is the first release with one")
def test_the_client_wheel_alone_at_its_oldest_runtimes_calls_a_daemon(module_daemon, tmp_path):
    """As in an engine's environment after `pip install radixkv` with gRPC as old as the
    client allows: the client's wheel and FLOORS in a folder, and Python started without
    site-packages (-S), so torch, numpy, the daemon and the rest are not there at all."""
    site, source = tmp_path / "site", tmp_path / "client"  # built from a copy: setuptools writes build/ there
    shutil.copytree(REPO / "client", source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-warn-conflicts", "--target",
                           str(site), "--only-binary=:all:", *FLOORS, str(source)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert not (site / "torch").exists() and not (site / "radixkv_server").exists()
    assert (site / "radixkv" / "py.typed").exists()
    script = f"""
import google.protobuf, grpc, radixkv
from radixkv import Client, errors
with Client({module_daemon.target!r}, timeout=10) as kv:
    kv.wait_ready(10)
    print(grpc.__version__, google.protobuf.__version__, radixkv.__version__, kv.stats().version,
          kv.check_invariants())
    try:
        kv.drop_namespace("never-registered")
    except errors.NotFound as e:  # the refusal's ErrorInfo, read by these runtimes too
        print(e.reason, e.metadata["namespace"])
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True, timeout=60,
                          env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    version = CLIENT["version"]
    assert done.stdout.split() == ["1.66.2", "5.27.2", version, version, "[]", "NAMESPACE_UNKNOWN", "never-registered"]
    # Its command says which extra it needs (it failed with an import traceback).
    assert "from radixkv.commands import sim" in (site / "bin" / "radixkv-sim").read_text()
    done = subprocess.run([sys.executable, "-S", "-c", "from radixkv.commands import sim; raise SystemExit(sim())"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert done.returncode == 2 and "radixkv-sim needs torch: pip install 'radixkv[buffers]'" in done.stderr
    assert "Traceback" not in done.stderr
