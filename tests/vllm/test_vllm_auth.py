"""The connector reaches a daemon that requires a token (`--auth-token`): both sides, the
workers' adapter and the scheduler's lookups, send it, from the config or from a file;
without it vLLM's start fails saying why. (TLS keys go the same way into the same Client
arguments; the daemon's TLS is tested in tests/service/test_security.py.)"""

import pytest

from radixkv.vllm.config import INLINE_TOKEN, TOKEN_ENV, ConnectorConfig
from radixkv.vllm.daemon import DaemonAdapter
from radixkv.vllm.kvmemory import describe
from radixkv.vllm.lookups import Lookups
from tests.support.daemon import DaemonProcess
from tests.vllm.log_lines import LogLines
from tests.vllm.test_vllm_adapter import SAVED, TOKENS, shm_kv  # noqa: F401 (fixture)

TOKEN = "s3cret-for-vllm"


@pytest.fixture
def guarded_daemon():
    d = DaemonProcess("--auth-token", TOKEN, probe={"token": TOKEN}).start()
    yield d
    d.stop()
    d.cleanup()


def test_the_connector_sends_the_token_from_its_config_a_file_or_the_environment(
        shm_kv, guarded_daemon, tmp_path, monkeypatch):
    views, alloc = shm_kv
    memory = describe(views, alloc.segment.tensor, alloc.segment.name.encode(), TOKENS)
    (tmp_path / "token").write_text(TOKEN + "\n")
    for i, extra in enumerate(({"token": TOKEN}, {"token_file": str(tmp_path / "token")}, {TOKEN_ENV: TOKEN})):
        if TOKEN_ENV in extra:
            monkeypatch.setenv(TOKEN_ENV, extra.pop(TOKEN_ENV))
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


def test_a_token_given_inline_is_warned_about_as_vllm_logs_it(tmp_path, monkeypatch):
    """vLLM prints kv_transfer_config in its "non-default args" startup line, so a `token`
    in the extra config lands in vLLM's log: the connector says so and names the ways
    that keep it out; neither of them warns."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.serve.utils.api_utils import get_non_default_args, redact_sensitive_args

    (tmp_path / "token").write_text(TOKEN)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with LogLines() as lines:
        ConnectorConfig.from_extra({"token": TOKEN}, "m")
    assert lines.messages() == [INLINE_TOKEN] and "token_file" in INLINE_TOKEN and TOKEN_ENV in INLINE_TOKEN
    for extra in ({"token_file": str(tmp_path / "token")}, {}):
        with LogLines() as lines:
            assert ConnectorConfig.from_extra(extra, "m").channel()["token"] == TOKEN
        assert lines.messages() == []
        args = EngineArgs(model="m", kv_transfer_config=KVTransferConfig(
            kv_connector="RadixKVConnector", kv_role="kv_both", kv_connector_extra_config=extra))
        assert TOKEN not in str(redact_sensitive_args(get_non_default_args(args)))  # what vLLM logs
