"""Ids from before a daemon restart. The scheduler may hold a hit (node, lease) while the
daemon is SIGKILLed and restarted behind the same socket. Counted from 1 in every daemon,
such a stale pair named another prompt's path on the new daemon: the LoadBack succeeded,
copied that prompt's KV into the request's blocks, and vLLM was told they loaded fine.
Ids now start at a random point per daemon (server core/ids.py), so the load fails and
vLLM recomputes. And one stale lease in a batched Release (all or nothing) no longer
keeps the valid leases of the batch held.

Driven with the connector's own scheduler lookups (`Lookups` on its pump) and a worker's
`WorkerLoads`/`DaemonAdapter`, against a real daemon SIGKILLed and restarted (what
test_vllm_daemon_away does to a real engine). Found by a review (2026-12-05).
"""
import contextlib
import time

import torch

from radixkv.errors import RadixKVError
from radixkv.types import Prompt
from radixkv.vllm.config import ConnectorConfig
from radixkv.vllm.daemon import DaemonAdapter
from radixkv.vllm.kvmemory import describe
from radixkv.vllm.loads import WorkerLoads
from radixkv.vllm.lookups import Lookups
from radixkv.vllm.metadata import LoadSpec
from radixkv.vllm.saves import Saves
from tests.support.daemon import wait_for
from tests.vllm.test_vllm_adapter import TOKENS, shm_kv  # noqa: F401 (fixture)

A = torch.arange(10, 10 + 2 * TOKENS, dtype=torch.int32).numpy().tobytes()      # prompt A, 2 pages
B = torch.arange(9000, 9000 + 2 * TOKENS, dtype=torch.int32).numpy().tobytes()  # prompt B, 2 pages


def fill(views, blocks, value):
    for v in views.values():
        for b in blocks:
            v[b].fill_(value)


def save(adapter, tokens, blocks):
    """Save until the (re-registered) session takes it and the copy is acknowledged."""
    for _ in range(200):
        try:
            t = adapter.save(tokens, blocks)
        except RadixKVError:
            t = 0
        if t and adapter.done([t], timeout=None) == {t}:
            return
        adapter._saves_resume_at = 0.0  # (do not wait out the skip window in a test)
        time.sleep(0.05)
    raise AssertionError("save never went through")


def hit_of(lookups, req, prompt):
    for _ in range(400):
        hit = lookups.poll(req, lambda: Prompt(prompt, b""))
        lookups.send()
        if hit is not None:
            if hit.tokens:
                return hit
            lookups.take(req)  # a miss while the session came back: ask again
        time.sleep(0.01)
    raise AssertionError(f"no hit for {req}")


@contextlib.contextmanager
def connector_sides(shm_kv, daemon, namespace: str):
    """(KV views, a worker's DaemonAdapter, the scheduler's Lookups) on `namespace`."""
    views, alloc = shm_kv
    memory = describe(views, alloc.segment.tensor, alloc.segment.name.encode(), TOKENS)
    config = ConnectorConfig(target=daemon.target, namespace=namespace, timeout_s=2.0)
    adapter = DaemonAdapter(config, engine="worker")
    try:
        adapter.attach(memory.layout, memory.buffers, memory.num_blocks)
        lookups = Lookups.open(config, memory.layout, engine="scheduler", tp_size=1, instance="")
        try:
            yield views, adapter, lookups
        finally:
            lookups.close()
    finally:
        adapter.close()


def test_a_hit_held_across_a_daemon_restart_fails_its_load_instead_of_loading_another_prompt(shm_kv, daemon):  # noqa: F811
    with connector_sides(shm_kv, daemon, "restart") as (views, adapter, lookups):
        saves = Saves(adapter)
        loads = WorkerLoads(adapter, saves, None)
        try:
            fill(views, [1, 2], 1.0)  # A's KV
            save(adapter, A, [1, 2])
            hit_of(lookups, "reqA", A)  # reqA waits (vLLM had no free blocks yet)

            daemon.kill()
            daemon.restart()

            fill(views, [3, 4], 2.0)  # B's KV, saved to the restarted daemon
            save(adapter, B, [3, 4])
            hit_of(lookups, "reqB", B)

            # vLLM now allocates reqA's blocks 7 and 8: update_state_after_alloc takes its hit.
            stale = lookups.take("reqA")
            fill(views, [7, 8], -1.0)
            spec = LoadSpec("reqA", (7, 8), 0, stale.node, stale.lease)
            loads.begin_early([spec])
            loads.load([spec])
            loads.forward_queued([spec])
            errors = loads.take_errors()
            got = next(iter(views.values()))[7].flatten()[0].item()
            assert got != 2.0, "reqA was loaded with prompt B's KV"
            assert errors == {7, 8} and got == -1.0, "the stale hit's load fails: vLLM recomputes both blocks"
        finally:
            saves.close()


def namespace_leases(target, ns):
    from radixkv import Client
    with Client(target) as c:
        [n] = c.stats(ns).namespaces
        return n.leases


def test_a_stale_lease_in_a_release_batch_does_not_keep_the_others_held(shm_kv, daemon):  # noqa: F811
    with connector_sides(shm_kv, daemon, "leak") as (views, adapter, lookups):
        fill(views, [1, 2], 1.0)
        save(adapter, A, [1, 2])
        for i in range(5):  # earlier requests, looked up and finished
            hit_of(lookups, f"old{i}", A)
            lookups.drop(f"old{i}")
        hit_of(lookups, "reqC", A)  # reqC waits for blocks, holding its hit

        daemon.kill()
        daemon.restart()

        fill(views, [3, 4], 2.0)
        save(adapter, B, [3, 4])
        hit_of(lookups, "reqB", B)
        # Both requests are aborted in the same step (request_finished -> Lookups.drop).
        lookups.drop("reqC")
        lookups.drop("reqB")
        # Engine steps (passes run the Release) until reqB's lease is released, which went
        # out in one Release with reqC's stale one.
        wait_for(lambda: (lookups.send(), namespace_leases(daemon.target, "leak") == 0)[1], 20,
                 "every lease released")
