"""The engine's event (issue 19) travels end to end: a real Client, the real gRPC
servicer and Daemon (in this process, on a unix socket), the copy engine, and the
device backend's submit, which must receive the event the engine sent. On shared
memory the event is accepted and ignored (copies run on the CPU after the request
arrived); the backend here is the real shared-memory one plus a log of the `after`
each copy was submitted with. Also: a re-registration exports CUDA buffers afresh.
"""

import asyncio
import threading

import grpc
import pytest
from radixkv.v1 import radixkv_pb2_grpc as pb_grpc

from radixkv import errors
from radixkv.client import Client
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.layout import KvLayout
from radixkv.reconnect import Backoff
from radixkv.types import pack
from radixkv_server.config import DaemonConfig
from radixkv_server.datapath import BACKENDS
from radixkv_server.datapath.shm import ShmDeviceBuffers
from radixkv_server.service.daemon import Daemon
from radixkv_server.service.servicer import RadixKVServicer

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", page_size=4)
NUM_PAGES = 16
EVENT = {name: bytes([i]) * 64 for i, name in enumerate(("insert", "evict", "load_back"), start=1)}


class LoggingShm(ShmDeviceBuffers):
    """The real shared-memory backend; every submit also logs (direction, after), and
    every open its specs, in `SUBMITS` / `OPENS`."""

    def submit_load(self, host_pool, host_pages, device_pages, after=b""):
        SUBMITS.append(("load", after))
        return super().submit_load(host_pool, host_pages, device_pages, after)

    def submit_store(self, device_pages, host_pool, host_pages, after=b""):
        SUBMITS.append(("store", after))
        return super().submit_store(device_pages, host_pool, host_pages, after)


SUBMITS: list[tuple[str, bytes]] = []
OPENS: list[list] = []


def _open_logging(layout, num_pages, specs, device, device_uuid="", owner_uid=None):
    OPENS.append(list(specs))
    return LoggingShm(layout, num_pages, specs, owner_uid)


class InProcessDaemon:
    """The real servicer and Daemon on an event loop in a thread, serving `target`.
    `restart()` replaces the daemon (a new instance on the same socket)."""

    def __init__(self, sock: str, policy: str):
        self.target = f"unix://{sock}"
        self._policy = policy
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._run(self._start())

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    async def _start(self):
        self.daemon = Daemon(DaemonConfig(host_pool_size=64 * LAYOUT.page_bytes, write_policy=self._policy))
        self.server = grpc.aio.server()
        pb_grpc.add_RadixKVServicer_to_server(RadixKVServicer(self.daemon), self.server)
        self.server.add_insecure_port(self.target)
        await self.server.start()

    async def _stop(self):
        await self.server.stop(0)
        await self.daemon.close()

    def restart(self):
        self._run(self._stop())
        self._run(self._start())

    def close(self):
        self._run(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def served(tmp_path, monkeypatch):
    monkeypatch.setitem(BACKENDS, "shm", _open_logging)
    SUBMITS.clear()
    OPENS.clear()
    daemons = []

    def start(policy: str) -> InProcessDaemon:
        daemons.append(InProcessDaemon(str(tmp_path / "radixkv.sock"), policy))
        return daemons[-1]

    yield start
    for d in daemons:
        d.close()


@pytest.fixture
def buffers():
    b = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
    yield b
    b.close()


def specs(buffers: ShmKvBuffers) -> list[tuple]:
    return [(s.handle, s.offset, s.size) for s in buffers.specs()]


def tokens(first: int, pages: int) -> bytes:
    return pack(range(first, first + pages * LAYOUT.page_size))


def test_the_engine_event_reaches_the_copy_of_each_call(served, buffers):
    d = served("write_back")
    with Client(d.target, timeout=10) as c:
        c.register("ev/tp0", LAYOUT, specs(buffers), NUM_PAGES)
        prompt = tokens(0, 2)
        c.insert(prompt, [0, 1], engine_event=EVENT["insert"])  # write-back: no copy yet
        assert SUBMITS == []
        freed = c.evict(2, engine_event=EVENT["evict"])          # write-backs read the pages after it
        assert list(freed.freed_pages) == [0, 1] and freed.written_back_pages == 2
        assert SUBMITS == [("store", EVENT["evict"])]
        [m] = c.match([prompt])
        lb = c.load_back(m.host_node, [5, 6], engine_event=EVENT["load_back"])
        assert c.wait([lb.transfer])[lb.transfer].ok
        assert SUBMITS[-1] == ("load", EVENT["load_back"])


def test_a_later_copy_waits_for_the_latest_event(served, buffers):
    d = served("write_through")
    with Client(d.target, timeout=10) as c:
        c.register("ev/tp0", LAYOUT, specs(buffers), NUM_PAGES)
        c.insert(tokens(0, 1), [0], engine_event=EVENT["insert"])
        c.insert(tokens(100, 1), [1])  # no event of its own: the backup still orders after the last one
        c.evict(2)
        assert [after for _, after in SUBMITS] == [EVENT["insert"], EVENT["insert"]]


def test_an_event_that_is_no_ipc_handle_is_refused(served, buffers):
    d = served("write_back")
    with Client(d.target, timeout=10) as c:
        c.register("ev/tp0", LAYOUT, specs(buffers), NUM_PAGES)
        with pytest.raises(errors.InvalidArgument, match="engine_event is 3 bytes; a CUDA IPC event handle is 64"):
            c.insert(tokens(0, 1), [0], engine_event=b"abc")
        with pytest.raises(errors.InvalidArgument, match="interprocess torch.cuda.Event"):
            c.evict(1, engine_event=42)


def test_a_uuid_the_daemon_cannot_see_is_a_clear_error(served, buffers):
    d = served("write_back")
    with Client(d.target, timeout=10) as c:
        with pytest.raises(errors.InvalidArgument, match="GPU 'GPU-0000feed' is not visible to the daemon"):
            c.register("ev/tp0", LAYOUT, specs(buffers), NUM_PAGES, backend="cuda", device_uuid="GPU-0000feed")


class Reexporting(list):
    """Specs that can be exported afresh, like `CudaKvBuffers.export`'s `CudaExport`
    (whose `fresh` makes new CUDA IPC handles); here shared-memory specs, counted."""

    def __init__(self, buffers: ShmKvBuffers):
        super().__init__(specs(buffers))
        self.buffers = buffers
        self.fresh_calls = 0

    def fresh(self):
        self.fresh_calls += 1
        return specs(self.buffers)


def test_each_re_registration_exports_the_buffers_afresh(served, buffers):
    d = served("write_back")
    export = Reexporting(buffers)
    with Client(d.target, timeout=10, reconnect=Backoff(initial=0.01, maximum=0.05)) as c:
        c.register("ev/tp0", LAYOUT, export, NUM_PAGES)
        assert export.fresh_calls == 0 and len(OPENS) == 1
        for restart in (1, 2):
            d.restart()
            lost = c.reconnect(timeout=10)
            assert isinstance(lost, errors.SessionLost)
            assert export.fresh_calls == restart and len(OPENS) == 1 + restart  # one new export per Register
