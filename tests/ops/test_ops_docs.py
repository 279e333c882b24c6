"""docs/operations.md and the README are true: their commands run against a live
daemon, the metric table names exactly the metrics the daemon exports, and every log
event the daemon can write is named in the Logs section."""

import json
import re
import tempfile

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.support.daemon import DaemonProcess, stop_all

from opstools import REPO, run_tool
from rawengine import RawEngine

DOC = REPO / "docs" / "operations.md"
DOCS_WITH_COMMANDS = (DOC, REPO / "README.md")
DEFAULT_SOCKET_PATH = "/run/radixkv/radixkv.sock"
DEFAULT_METRICS = "127.0.0.1:9464"
NAMESPACE = "llama3-8b/tp0"  # the namespace the documented commands name


def documented_commands() -> list[str]:
    """Every line of the ```sh blocks (the runnable ones; ```text blocks are examples)."""
    blocks = [b for doc in DOCS_WITH_COMMANDS
              for b in re.findall(r"^```sh\n(.*?)^```", doc.read_text(), flags=re.S | re.M)]
    return [line for block in blocks for line in block.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def storage_daemon():
    """A daemon with a file storage tier and KV events (so the storage and event metrics
    exist too) and an engine attached to the documented namespace."""
    store = tempfile.TemporaryDirectory(prefix="rkv-ops-l3-")
    d = DaemonProcess("--storage", store.name, "--kv-events-watch", "true", metrics=True, split_logs=True)
    try:
        d.start()
        engine = RawEngine(d.target, NAMESPACE)
        assert engine.cycle(32) == 32
        yield d
        engine.close()
        engine.release_memory()
    finally:
        stop_all([d])
        store.cleanup()


def test_every_documented_command_runs(storage_daemon, tool_env):
    commands = documented_commands()
    assert any(c.startswith("grpcurl") for c in commands) and any(c.startswith("curl") for c in commands)
    env = {**tool_env, "RADIXKV_LISTEN": storage_daemon.target}  # what the bare `radixkv-health` reads
    outputs = {}
    for command in commands:
        assert DEFAULT_SOCKET_PATH in command or DEFAULT_METRICS in command or command == "radixkv-health", (
            f"documented command does not name the default socket or metrics address: {command}")
        local = (command.replace(DEFAULT_SOCKET_PATH, storage_daemon.socket)
                 .replace(DEFAULT_METRICS, f"127.0.0.1:{storage_daemon.metrics_port}"))
        done = run_tool(["bash", "-c", local], env=env, check=False)
        assert done.returncode == 0 and done.stdout.strip(), (
            f"documented command failed: {command}\n{done.stdout}\n{done.stderr}")
        outputs[command] = done.stdout
    stats = next(out for cmd, out in outputs.items() if f'"namespace": "{NAMESPACE}"' in cmd and "/Stats" in cmd)
    assert f'"namespace": "{NAMESPACE}"' in stats and '"loaded_tokens": "32"' in stats
    checked = json.loads(next(out for cmd, out in outputs.items() if "CheckInvariants" in cmd))
    assert checked == {"violations": [], "namespaces_checked": 1}
    assert "radixkv_load_back_tokens_total" in next(out for cmd, out in outputs.items() if cmd.startswith("curl"))


def documented_metrics() -> set[str]:
    return set(re.findall(r"^\| `(radixkv_[a-z0-9_]+)` \|", DOC.read_text(), flags=re.M))


def test_metric_table_lists_exactly_the_exported_metrics(storage_daemon):
    exported = set()
    for family in text_string_to_metric_families(storage_daemon.scrape()):
        if family.name.startswith("radixkv_"):
            exported.add(family.name + ("_total" if family.type == "counter" else ""))
    documented = documented_metrics()
    assert len(documented) > 20
    assert exported - documented == set(), f"exported but not documented: {sorted(exported - documented)}"
    assert documented - exported == set(), f"documented but not exported: {sorted(documented - exported)}"


def test_every_log_event_the_daemon_writes_is_documented():
    """An operator filtering on an event name (an alert on `storage.disk_full`) finds it
    in docs/operations.md; the storage backends' warnings were free sentences, each line
    an `event` of its own, until they got names."""
    server = REPO / "server" / "radixkv_server"
    written = {name for path in server.rglob("*.py")
               for name in re.findall(r'log_event\(\s*\w+,\s*"([a-z0-9_.]+)"', path.read_text())}
    assert len(written) > 60
    logs = DOC.read_text()
    assert {name for name in written if f"`{name}`" not in logs} == set()
    storage = server / "storage"
    sentences = [f"{path.name}: {line.strip()}" for path in storage.rglob("*.py")
                 for line in path.read_text().splitlines() if re.search(r"\blog\.(info|warning|error)\(", line)]
    assert sentences == []  # the storage tier's lines are events with fields, like the rest
