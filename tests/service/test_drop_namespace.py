"""DropNamespace: an operator frees a namespace no engine is attached to (a model no
longer served) without restarting the daemon; with `store`, its host tier goes to
storage first, where a later engine of that model finds it."""

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from radixkv import errors
from radixkv.client import Client
from tests.support.daemon import wait_for
from tests.support.engine import LAYOUT, PS, EngineDouble, prompt

DEADLINE_S = 20.0
PROMPTS = 3
PAGES = 8  # per prompt
HOST_PAGES = 64


def fill_host(engine: EngineDouble) -> None:
    engine.prefill_to_host([prompt(i) for i in range(PROMPTS)])


@pytest.fixture
def admin(daemon):
    client = Client(daemon, timeout=DEADLINE_S)
    yield client
    client.close()


def test_a_dropped_namespace_is_gone_and_its_next_engine_starts_cold(daemon, admin):
    engine = EngineDouble.connect(daemon, host_pool_pages=HOST_PAGES)
    fill_host(engine)
    engine.close()
    other = EngineDouble.connect(daemon, "other/tp0")  # another model's namespace is untouched
    try:
        other.prefill(prompt(9))
        dropped = admin.drop_namespace("model/tp0")
        assert dropped.host_tokens == PROMPTS * PAGES * PS and dropped.stored_tokens == 0
        assert dropped.freed_host_bytes == HOST_PAGES * LAYOUT.page_bytes
        assert [ns.namespace for ns in admin.stats().namespaces] == ["other/tp0"]
        [m] = other.client.match([prompt(9)])
        assert m.device_tokens == PAGES * PS
    finally:
        other.close()
    engine = EngineDouble.connect(daemon, host_pool_pages=HOST_PAGES)
    try:
        assert engine.registration.warm is False
        [m] = engine.client.match([prompt(0)])
        assert (m.device_tokens, m.host_tokens) == (0, 0)
        assert engine.client.check_invariants() == []
    finally:
        engine.close()


def test_an_attached_unknown_or_unnamed_namespace_is_refused_saying_why(daemon, admin):
    engine = EngineDouble.connect(daemon, engine="vllm-0")
    try:
        engine.prefill(prompt(1))
        with pytest.raises(errors.FailedPrecondition, match="vllm-0"):
            admin.drop_namespace("model/tp0")
        with pytest.raises(errors.NotFound, match="model/tp0"):  # the known names are listed
            admin.drop_namespace("no/such")
        with pytest.raises(errors.InvalidArgument):
            admin.drop_namespace("")
        [m] = engine.client.match([prompt(1)])  # the engine never noticed
        assert m.device_tokens == PAGES * PS
    finally:
        engine.close()
    with pytest.raises(errors.FailedPrecondition, match="no storage tier"):  # nothing would keep the host copies
        admin.drop_namespace("model/tp0", store=True)
    assert [ns.namespace for ns in admin.stats().namespaces] == ["model/tp0"]  # still there


def test_a_drop_that_stores_first_leaves_the_prefixes_in_storage(daemon_factory, tmp_path):
    d = daemon_factory("--storage", f"file://{tmp_path}/pages")  # storage write-back: nothing stored yet
    engine = EngineDouble.connect(d.target)
    fill_host(engine)
    assert engine.counters()["stored_tokens"] == 0
    engine.close()
    with Client(d.target, timeout=DEADLINE_S) as admin:
        dropped = admin.drop_namespace("model/tp0", store=True)
    assert dropped.stored_tokens == dropped.host_tokens == PROMPTS * PAGES * PS
    engine = EngineDouble.connect(d.target)
    try:
        for i in range(PROMPTS):
            [m] = engine.client.match([prompt(i)], include_storage=True)
            assert (m.host_tokens, m.storage_tokens) == (0, PAGES * PS)
            engine.client.prefetch(prompt(i), policy="wait_complete")
            loaded, mismatches = engine.load(prompt(i))
            assert loaded == PAGES * PS and mismatches == (0, 0)
    finally:
        engine.close()


def test_a_drop_storing_into_a_frozen_store_holds_no_other_namespaces_register(private_redis, daemon_factory):
    """A DropNamespace waits for its stores with the namespace locked; a tenant's engine
    registering another namespace meanwhile is answered at once (it waited for the whole
    store before). A Register of the namespace being dropped waits for the drop."""
    d = daemon_factory("--storage", private_redis.url + "?socket_timeout=60", "--shutdown-store-timeout", "60")
    engine = EngineDouble.connect(d.target, host_pool_pages=HOST_PAGES)  # write-back: nothing stored yet
    fill_host(engine)
    engine.close()
    os.kill(private_redis.proc.pid, signal.SIGSTOP)
    try:
        with Client(d.target, timeout=DEADLINE_S * 3) as admin, ThreadPoolExecutor(1) as pool:
            drop = pool.submit(admin.drop_namespace, "model/tp0", store=True)
            wait_for(lambda: admin.stats("model/tp0").namespaces[0].transfers_in_flight > 0, DEADLINE_S,
                     "the drop's stores to start")
            other = EngineDouble.connect(d.target, "other/tp0")  # within its Register's deadline (20 s)
            try:
                other.prefill(prompt(9))
                [m] = other.client.match([prompt(9)])
                assert m.device_tokens == PAGES * PS
            finally:
                other.close()
            with pytest.raises(errors.DeadlineExceeded):  # the dropped namespace's own Register waits
                EngineDouble(LAYOUT, 16).register(Client(d.target, timeout=1.0), "model/tp0")
            assert not drop.done()
            os.kill(private_redis.proc.pid, signal.SIGCONT)
            dropped = drop.result()
    finally:
        os.kill(private_redis.proc.pid, signal.SIGCONT)
    assert dropped.stored_tokens == dropped.host_tokens == PROMPTS * PAGES * PS
