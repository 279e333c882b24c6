"""At a graceful shutdown, what only the host tier holds goes to storage first.

Under storage write-back (the default) a host copy reaches storage only when the host
tier evicts it, so the host pool's contents would end with the process, and a restarted
daemon would find in storage only what was evicted before. So, once the engines'
sessions are closed and before its namespaces close, the daemon stores every host copy
that storage lacks (`HierarchicalCache.unstored_host_nodes`): parents before children, a
store per worker in flight, until all are stored, a store fails (the storage tier is
down or full: the rest would fail alike), or the time given is up
(`--shutdown-store-timeout`, shared by all namespaces). Stores in flight then still
complete while the namespace closes, within the storage tier's own timeouts. Progress is
logged each second (`shutdown.storing`) and the outcome per namespace (`shutdown.stored`).
"""

import asyncio
import logging
import time
from collections.abc import Iterator

from ..core.node import Node
from ..logs import log_event
from .namespace_core import NamespaceCore

log = logging.getLogger("radixkv.daemon")

PROGRESS_EVERY_S = 1.0
ALL_STORED = "all stored"


async def store_host_copies(core: NamespaceCore, deadline: float, event: str = "shutdown") -> int:
    """Store `core`'s host copies that storage lacks until done, a store fails, or
    `deadline` (time.monotonic) passes; logs progress (`<event>.storing`) and the outcome
    (`<event>.stored`: "namespace" for a DropNamespace). Returns the pages stored.
    Nothing to do without a storage tier."""
    cache, copies, config = core.cache, core.copies, core.config
    nodes = cache.unstored_host_nodes() if copies.storage is not None else []
    if not nodes:
        return 0
    pages_of = cache.tree.pages_of
    total = sum(pages_of(n) for n in nodes)
    in_flight = config.storage_workers
    batches = _batches(nodes, max(1, config.storage_queue_pages // (2 * in_flight)), pages_of)  # within the queue
    started = last_report = time.monotonic()
    flying: dict[asyncio.Task, list[Node]] = {}  # a store's wait -> the nodes it took
    stored, left, outcome = 0, True, ALL_STORED
    try:
        while True:
            while left and len(flying) < in_flight and outcome == ALL_STORED:
                batch = next(batches, None)
                left = batch is not None
                transfer = cache.store_host_copies(batch) if left else 0
                if transfer:
                    flying[asyncio.ensure_future(copies.wait([transfer]))] = \
                        [n for n in batch if n.full.store == transfer]
            if not flying:
                break
            done, _ = await asyncio.wait(flying, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                taken = flying.pop(task)
                stored += sum(pages_of(n) for n in taken if n.full.stored)
                if not all(n.full.stored for n in taken):
                    outcome = "a store failed"
            now = time.monotonic()
            if now >= deadline and (flying or left):
                outcome = "time is up" if outcome == ALL_STORED else outcome
                break
            if now - last_report >= PROGRESS_EVERY_S:
                last_report = now
                log_event(log, f"{event}.storing", namespace=config.name, stored_pages=stored, of=total)
    finally:
        for task in flying:  # the stores go on; the namespace's close waits for them
            task.cancel()
    log_event(log, f"{event}.stored", logging.INFO if outcome == ALL_STORED else logging.WARNING,
              namespace=config.name, stored_pages=stored, of=total, seconds=round(time.monotonic() - started, 2),
              outcome=outcome)
    return stored


def _batches(nodes: list[Node], pages: int, pages_of) -> Iterator[list[Node]]:
    """`nodes` in order, in runs of at least `pages` pages (the last may have fewer)."""
    batch, n = [], 0
    for node in nodes:
        batch.append(node)
        n += pages_of(node)
        if n >= pages:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


__all__ = ["store_host_copies"]
