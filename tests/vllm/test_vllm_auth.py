"""The connector reaches a daemon that requires a token (`--auth-token`): both sides, the
workers' adapter and the scheduler's lookups, send it, from the config or from a file;
without it vLLM's start fails saying why. (TLS keys go the same way into the same Client
arguments; the daemon's TLS is tested in tests/service/test_security.py.)"""

import pytest

from radixkv.vllm.config import ConnectorConfig
from radixkv.vllm.daemon import DaemonAdapter
from radixkv.vllm.kvmemory import describe
from radixkv.vllm.lookups import Lookups
from tests.support.daemon import DaemonProcess
from tests.vllm.test_vllm_adapter import SAVED, TOKENS, shm_kv  # noqa: F401 (fixture)

TOKEN = "s3cret-for-vllm"


@pytest.fixture
def guarded_daemon():
    d = DaemonProcess("--auth-token", TOKEN, probe={"token": TOKEN}).start()
    yield d
    d.stop()
    d.cleanup()


def test_the_connector_sends_the_token_from_its_config_or_a_file(shm_kv, guarded_daemon, tmp_path):
    views, alloc = shm_kv
    memory = describe(views, alloc.segment.tensor, alloc.segment.name.encode(), TOKENS)
    (tmp_path / "token").write_text(TOKEN + "\n")
    for i, extra in enumerate(({"token": TOKEN}, {"token_file": str(tmp_path / "token")})):
        config = ConnectorConfig.from_extra({"target": guarded_daemon.target, "namespace": f"auth{i}", **extra}, "m")
        adapter = DaemonAdapter(config, engine="worker")
        lookups = None
        try:
            adapter.attach(memory.layout, memory.buffers, memory.num_blocks)
            transfer = adapter.save(SAVED, [1, 2])
            assert transfer and adapter.done([transfer], timeout=None) == {transfer}
            lookups = Lookups.open(config, memory.layout, engine="scheduler", tp_size=1, instance="")
        finally:
            if lookups is not None:
                lookups.close()
            adapter.close()


def test_without_the_token_vllm_does_not_start_and_says_why(shm_kv, guarded_daemon, tmp_path):
    views, alloc = shm_kv
    memory = describe(views, alloc.segment.tensor, alloc.segment.name.encode(), TOKENS)
    config = ConnectorConfig.from_extra({"target": guarded_daemon.target, "namespace": "noauth",
                                         "connect_timeout_s": 2.0}, "m")
    adapter = DaemonAdapter(config, engine="worker")
    try:
        with pytest.raises(RuntimeError, match="token"):
            adapter.attach(memory.layout, memory.buffers, memory.num_blocks)
    finally:
        adapter.close()
    with pytest.raises(ValueError, match="token_file .*: No such file"):
        ConnectorConfig.from_extra({"token_file": str(tmp_path / "missing")}, "m")
    with pytest.raises(ValueError, match="not both"):
        ConnectorConfig.from_extra({"token": "a", "token_file": "b"}, "m")
