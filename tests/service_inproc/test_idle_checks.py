"""Invariant checks while the daemon is idle (`invariant_check_interval`): a broken
invariant is logged and counted without anyone calling CheckInvariants, and no check
runs while engines keep calling (a check walks every tree on the event loop)."""

import asyncio
import logging
import time

from radixkv_server.service.idle_checks import IDLE_S

from tests.service_inproc.inproc import Engine, prompt, run, running_daemon, until


def test_an_idle_daemon_finds_a_broken_invariant_by_itself(caplog):
    async def scenario():
        async with running_daemon(invariant_check_interval=0.05) as daemon:
            daemon.start()
            e = await Engine.register(daemon, "t/idle", write_policy="write_back")
            await e.insert(prompt(0, 2), [0, 1])
            daemon.last_call = time.monotonic()  # in-process calls are not stamped by a servicer
            # (a setup slower than IDLE_S on a loaded machine may already have seen a check)
            runs = daemon.idle_checks.runs
            busy_until = asyncio.get_running_loop().time() + 2 * IDLE_S
            while asyncio.get_running_loop().time() < busy_until:  # an engine that keeps calling
                await e.match(prompt(0, 2))
                daemon.last_call = time.monotonic()  # as the servicer stamps each answered call
                await asyncio.sleep(0.01)
            assert daemon.idle_checks.runs == runs
            node = next(iter(e.ns.cache.state.tree.iter_nodes()))
            node.device_children += 1  # a bug's trace, as a wrong count would be
            with caplog.at_level(logging.ERROR, logger="radixkv.invariants"):
                await until(lambda: daemon.idle_checks.runs != runs, "an idle invariant check", timeout=20)
            assert any(r.getMessage() == "invariants.violated" and "device_children" in r.fields["violation"]
                       for r in caplog.records)
            node.device_children -= 1
            await e.close()
    run(scenario())
