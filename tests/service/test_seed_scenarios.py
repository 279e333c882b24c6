"""The seed's scenarios over gRPC: overlapping load-backs from two anchors over one
shared node, acknowledged in either order, and an engine killed with load-backs in
flight. Afterwards: no pin or lock left, duplicates tracked, invariants clean."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from radixkv.types import pack
from tests.support.daemon import wait_for
from tests.support.engine import PS, EngineDouble

DEADLINE_S = 20.0  # each bounded wait
COPY_DELAY_S = 0.5  # --fault-copy-delay: A's load is still copying when B's is asked for

SHARED = list(range(100, 100 + 4 * PS))
A = SHARED + list(range(500, 500 + 2 * PS))
B = SHARED + list(range(900, 900 + 2 * PS))


def host_only_tree(engine: EngineDouble) -> None:
    """Insert A and B (sharing SHARED), back them up, evict them from the device."""
    engine.prefill(A)
    engine.prefill(B)
    wait_for(lambda: engine.client.stats().namespaces[0].transfers_in_flight == 0, DEADLINE_S, "backups")
    while engine.client.stats().namespaces[0].device_pages_held:
        engine.evict(64)
    [m] = engine.client.match([A])
    assert (m.device_tokens, m.host_tokens) == (0, len(A))


def nodes(engine):
    return {n.id: n for n in engine.client.inspect("model/tp0").nodes}


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("reverse", [False, True])
def test_overlapping_load_backs_acked_in_either_order(daemon_factory, policy, reverse):
    """By construction: A's load copies SHARED and A's tail; B's, asked for while A's
    copy is still delayed, copies only B's tail and relies on A's for SHARED, so SHARED
    is pinned by both loads until each one's ACK removes its own pin."""
    daemon = daemon_factory("--fault-copy-delay", str(COPY_DELAY_S)).target
    engine = EngineDouble.connect(daemon, write_policy=policy)
    try:
        host_only_tree(engine)
        [ma, mb] = engine.client.match([A, B])
        la = engine.client.load_back(ma.host_node, engine.allocate(ma.host_tokens // PS))
        lb = engine.client.load_back(mb.host_node, engine.allocate(mb.host_tokens // PS))
        assert (la.loaded_tokens, lb.loaded_tokens) == (len(A), len(B) - len(SHARED))
        assert tuple(lb.depends_on) == (la.transfer,) and tuple(la.depends_on) == ()
        shared = next(n for n in nodes(engine).values() if n.depth == 1)
        assert shared.tokens == len(SHARED)
        assert set(shared.pins) == {la.transfer, lb.transfer}

        first, second = (lb, la) if reverse else (la, lb)
        assert engine.client.wait([first.transfer])[first.transfer].ok
        left = nodes(engine)[shared.id]
        assert set(left.pins) == {second.transfer}  # each ACK removes only its own
        assert engine.client.wait([second.transfer])[second.transfer].ok

        after = nodes(engine)
        assert all(not n.pins and n.host_lock == 0 for n in after.values())
        assert engine.client.stats().namespaces[0].tracked_duplicates >= 3
        for tokens, result in ((A, la), (B, lb)):
            assert engine.verify(pack(tokens), list(result.device_pages)) == (0, 0)
        assert engine.client.check_invariants() == []
    finally:
        engine.close()


ENGINE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from tests.support.engine import EngineDouble, PS
    engine = EngineDouble.connect({target!r}, write_policy={policy!r})
    A, B = {a!r}, {b!r}
    [ma, mb] = engine.client.match([A, B], lease=True)
    engine.client.load_back(ma.host_node, engine.allocate(ma.host_tokens // PS))
    engine.client.load_back(mb.host_node, engine.allocate(mb.host_tokens // PS))
    engine.client.wait([])  # opens the ack stream, acks nothing
    print("loading", flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_engine_killed_with_load_backs_in_flight_leaves_nothing_behind(daemon, policy):
    setup = EngineDouble.connect(daemon, write_policy=policy)
    try:
        host_only_tree(setup)
        setup.client.close()  # the namespace is free for the next engine
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        code = ENGINE.format(root=root, target=daemon, policy=policy, a=A, b=B)
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "loading"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        observer = EngineDouble.connect(daemon, write_policy=policy, replace_existing=True)
        try:
            # The dead engine's session closes when its ack stream breaks: its loads
            # finish and its leases go; the host tier stays.
            wait_for(lambda: all(not n.pins and n.lock_ref == 0 for n in nodes(observer).values()),
                     DEADLINE_S, "the dead session's pins and leases to go")
            assert observer.client.check_invariants() == []
            [m] = observer.client.match([A])
            assert m.device_tokens + m.host_tokens == len(A)
            loaded, mismatches = observer.load(A)
            assert loaded == len(A) and mismatches == (0, 0)
        finally:
            observer.close()
    finally:
        setup.buffers.close()
