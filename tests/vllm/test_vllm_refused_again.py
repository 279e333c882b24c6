"""A worker whose lost session the daemon refuses to register again says so in a warning,
as the scheduler's does. Here the daemon restarted empty and another engine took the
namespace first with another layout: every load of the worker is a miss from then on
until an operator acts, so one warning says so. The client raised the refusal as Unavailable, so both sessions
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


def refusals(caplog, who: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if f"{who}: registering the session again was refused" in r.getMessage()]


def test_a_worker_refused_after_a_restart_warns_once(shm_kv, daemon, caplog):  # noqa: F811
    """One warning for the run of refusals, the attempts that follow (every couple of
    seconds, for as long as it lasts) at debug: a warning each time flooded the log."""
    caplog.set_level(logging.DEBUG, logger="vllm.radixkv")
    with contextlib.ExitStack() as stack:
        views, adapter, scheduler = stack.enter_context(open_sessions(shm_kv, daemon))
        [hit] = scheduler.lookup([SAVED])
        daemon.kill()
        daemon.start()  # empty, on the same socket
        other = ShmKvBuffers.create(OTHER, 8)
        stack.callback(other.close)
        taker = stack.enter_context(Client(daemon.target, reconnect=None))
        taker.register("unit", OTHER, other.specs(), 8, engine="another model")

        def refused_thrice() -> list[logging.LogRecord]:
            adapter.finish_load(adapter.begin_load(hit.node, [8, 9], 0, hit.lease))  # fills none
            return len(refusals(caplog, "worker")) >= 3 and refusals(caplog, "worker")

        told = wait_for(refused_thrice, 60, "three refused attempts logged")
        assert [r.levelno for r in told[:3]] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
        assert "namespace unit has the other device tier" in told[0].getMessage(), told[0].getMessage()
        assert adapter.load(hit.node, [8, 9], 0, hit.lease) == 0  # still a miss: nothing to load

