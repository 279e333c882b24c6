"""gRPC's I/O layer (radixkv_server.grpc_io): the daemon asks for the polling I/O unless
GRPC_EXPERIMENTS is set, says so in its config line, and gRPC knows the experiments it
names; engines importing the client keep gRPC's default. Each case runs in a fresh
interpreter: gRPC reads the variable once per process."""

import os
import subprocess
import sys

from radixkv_server.grpc_io import POLLING_IO
from tests.support.daemon import DaemonProcess, stop_all

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(**overrides) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "client"), os.path.join(REPO, "server"), REPO])
    env.update(overrides)
    return env


def _experiments_after(code: str, **env) -> str:
    """GRPC_EXPERIMENTS as a fresh interpreter sees it after running `code`."""
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport os; print(os.environ.get('GRPC_EXPERIMENTS'))"],
                         env=_env(**env), capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


def test_the_daemon_entry_point_asks_for_the_polling_io_and_the_client_does_not():
    assert _experiments_after("import radixkv_server.cli") == POLLING_IO
    assert _experiments_after("import radixkv, radixkv.vllm.config") == "None"


def test_a_setting_in_the_environment_is_kept_even_an_empty_one():
    assert _experiments_after("import radixkv_server.cli", GRPC_EXPERIMENTS="") == ""
    assert _experiments_after("import radixkv_server.cli",
                              GRPC_EXPERIMENTS="-event_engine_client") == "-event_engine_client"


def test_nothing_is_changed_once_grpc_was_imported():
    assert _experiments_after("import grpc\nimport radixkv_server.cli") == "None"


def _config_line(log: str) -> str:
    return next(line for line in log.splitlines() if "config" in line and "grpc_io" in line)


def test_the_daemon_serves_on_the_polling_io_and_grpc_knows_the_experiments():
    """If a gRPC release drops these experiments it logs "Unknown experiment": this fails
    then, and radixkv_server.grpc_io must follow gRPC."""
    daemons = [DaemonProcess(env=_env()), DaemonProcess(env=_env(GRPC_EXPERIMENTS=""))]
    try:
        polling, default = (d.start().log() for d in daemons)  # the config line comes before ready
    finally:
        stop_all(daemons)
    assert "polling" in _config_line(polling) and "Unknown experiment" not in polling, polling[-2000:]
    assert "event_engine" in _config_line(default), default[-2000:]
