"""A worker whose lost session the daemon refuses to register again says so in a warning,
as the scheduler's does. Here the daemon restarted empty and another engine took the
namespace first with another layout: every load of the worker is a miss from then on
until an operator acts. The client raised the refusal as Unavailable, so both sessions
took it for a daemon still away and logged it at debug (found by a review of the
connector's two ways of registering again)."""

import contextlib
import logging

from radixkv import Client
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.layout import KvLayout
from tests.support.daemon import wait_for
from tests.vllm.test_vllm_adapter import SAVED, open_sessions, shm_kv  # noqa: F401 (a fixture)

OTHER = KvLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", page_size=32)


def refusals(caplog, who: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and f"{who}: registering the session again was refused" in r.getMessage()]


def test_a_worker_refused_after_a_restart_warns(shm_kv, daemon, caplog):  # noqa: F811
    caplog.set_level(logging.WARNING)
    with contextlib.ExitStack() as stack:
        views, adapter, scheduler = stack.enter_context(open_sessions(shm_kv, daemon))
        [hit] = scheduler.lookup([SAVED])
        daemon.kill()
        daemon.start()  # empty, on the same socket
        other = ShmKvBuffers.create(OTHER, 8)
        stack.callback(other.close)
        taker = stack.enter_context(Client(daemon.target, reconnect=None))
        taker.register("unit", OTHER, other.specs(), 8, engine="another model")

        def refused() -> list[str]:
            adapter.finish_load(adapter.begin_load(hit.node, [8, 9], 0, hit.lease))  # fills none
            return refusals(caplog, "worker")

        [message] = wait_for(refused, 30, "the worker's refusal logged")[:1]
        assert "namespace unit has the other device tier" in message, message
        assert adapter.load(hit.node, [8, 9], 0, hit.lease) == 0  # still a miss: nothing to load

