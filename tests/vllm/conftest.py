"""Fixtures for the vLLM tests: the tiny random Llama (built once per run), a real
radixkv daemon per test, and vLLM engines stopped at teardown.

vLLM's CPU settings are set before anything imports vLLM (it reads some at import).
"""

import pytest

from radixkv.vllm.testing import apply_cpu_env, write_tiny_llama

apply_cpu_env()
pytest.importorskip("vllm", reason="vLLM is not installed: `make vllm-install`")

from tests.support.daemon import DaemonProcess, stop_all  # noqa: E402

from tests.vllm.engines import Engines  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Directory of the tiny random Llama (seed 0)."""
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def daemon_factory():
    """start(*flags) -> a ready DaemonProcess; every one is stopped (exit 0) at teardown."""
    daemons = []

    def start(*flags: str) -> DaemonProcess:
        d = DaemonProcess("--host-pool-size", "128MiB", *flags)
        daemons.append(d)
        return d.start()

    yield start
    stop_all(daemons)


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    return daemon_factory()


@pytest.fixture
def engines(tiny_model):
    """Engines(tiny_model): start(...) vLLM engines; all are shut down at teardown."""
    e = Engines(tiny_model)
    yield e
    e.stop_all()
