"""An in-process daemon for service tests: a real `Daemon`, its namespaces, sessions and
copy threads on the test's own event loop, and engines whose device buffers are real
shared-memory segments. No daemon process and no gRPC: a test calls what the servicer
would call (`Daemon.register`, then the session's `Namespace`), so a rule of the service
layer is checked in milliseconds, and a caller error is the `ServiceError` or core error
that the servicer would turn into a status (`errors.status_of`).
"""

import asyncio
from contextlib import asynccontextmanager

from radixkv.kvbuffers import ShmKvBuffers
from radixkv.layout import KvLayout
from radixkv.types import pack
from radixkv_server.config import DaemonConfig
from radixkv_server.service.calls import EvictAnswer, InsertAnswer, InsertRequest, MatchAnswer, Prompt
from radixkv_server.service.daemon import Daemon
from radixkv_server.service.registration import Registration

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", page_size=4)
NUM_PAGES = 32  # device pages per engine
HOST_PAGES = 64


def prompt(first: int, pages: int) -> bytes:
    """Packed tokens first, first+1, ... filling `pages` whole pages."""
    return pack(range(first, first + pages * LAYOUT.page_size))


@asynccontextmanager
async def running_daemon(**config):
    """A Daemon with a small host pool (no metrics, no storage, timeouts not running:
    call `daemon.expiry.expire(now)` to expire). Closed on exit, as at shutdown."""
    config.setdefault("host_pool_size", HOST_PAGES * LAYOUT.page_bytes)
    daemon = Daemon(DaemonConfig(**config))
    try:
        yield daemon
    finally:
        await daemon.close()


class Engine:
    """One engine: its device buffers in shared memory and its session on `daemon`."""

    def __init__(self, daemon: Daemon, buffers: ShmKvBuffers, session):
        self.daemon = daemon
        self.buffers = buffers
        self.session = session

    @classmethod
    async def register(cls, daemon: Daemon, namespace: str, *, write_policy: str = "write_back",
                       replace: bool = False, tp_rank: int = 0, tp_size: int = 1, instance: str = "",
                       **fields) -> "Engine":
        """Register new device buffers on `daemon` (`fields`: more of Registration's, a
        caller's `owner` and `quota`)."""
        buffers = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
        try:
            done = await daemon.register(Registration(
                namespace=namespace, layout=LAYOUT, backend="shm", device=0, buffers=buffers.specs(),
                num_device_pages=NUM_PAGES, write_policy=write_policy, replace_existing=replace,
                tp_rank=tp_rank, tp_size=tp_size, instance=instance, **fields))
        except BaseException:
            buffers.close()
            raise
        return cls(daemon, buffers, done.session)

    @property
    def ns(self):
        return self.session.namespace

    async def insert(self, tokens: bytes, pages: list[int], **kw) -> InsertAnswer:
        return await self.ns.insert(self.session, InsertRequest(tokens, pack(pages), **kw))

    async def match(self, tokens: bytes, lease: bool = False) -> MatchAnswer:
        (answer,) = await self.ns.match(self.session, [Prompt(tokens)], lease)
        return answer

    def release(self, leases: list[int]) -> None:
        self.ns.release(self.session, leases)

    async def evict(self, num_pages: int) -> EvictAnswer:
        return await self.ns.evict(self.session, num_pages)

    def fill(self, pages: list[int], seed: int) -> None:
        """Write a distinct byte pattern into device pages `pages` of every buffer."""
        for b in range(LAYOUT.num_buffers):
            view = self.buffers.page_view(b)
            for i, page in enumerate(pages):
                view[page].fill_((seed + 7 * b + 13 * i) % 251)

    def page_bytes(self, pages: list[int]) -> list[bytes]:
        return [bytes(self.buffers.page_view(b)[p].numpy()) for p in pages for b in range(LAYOUT.num_buffers)]

    async def close(self) -> None:
        await self.daemon.close_session(self.session, "closed by the test")
        self.buffers.close()


async def exposition(metrics) -> str:
    """The /metrics text of `metrics` (a real Metrics registry watching an in-process
    daemon), generated on a thread: its collector waits for a snapshot taken on the loop."""
    from prometheus_client import generate_latest
    return (await asyncio.to_thread(generate_latest, metrics.registry)).decode()


async def cancelled_at_first_await(coro) -> None:
    """Run `coro` until it first waits, then cancel it there, as a deadline would."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)
    assert not task.done(), "the call should be waiting (for a copy or the store)"
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return
    raise AssertionError("the call finished instead of being cancelled")


async def until(condition, what: str, timeout: float = 10.0) -> None:
    """Let the loop run until `condition()` holds (bounded)."""
    async def poll():
        while not condition():
            await asyncio.sleep(0.001)
    try:
        await asyncio.wait_for(poll(), timeout)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def run(coro):
    """Run one scenario on a fresh event loop (the loop owns the daemon, as in serve())."""
    return asyncio.run(coro)


__all__ = ["Engine", "LAYOUT", "NUM_PAGES", "cancelled_at_first_await", "exposition", "prompt", "run",
           "running_daemon"]
