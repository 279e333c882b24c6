"""The engine double the test engines build on: one engine's device side in shared
memory, and the few client steps tests keep repeating.

It is made of the simulator's pieces (`radixkv.sim`): `SimBuffers` (the KV buffers the
daemon copies from and into: shared memory, or CUDA tensors on a GPU), `KvPattern` (KV
bytes that name their tokens, so a page holding anything but its own prefix's KV is
counted as a mismatch) and `PagePool` (who holds each device page: the engine, a
request, or the cache; a wrong move is counted in `pool.errors`, never asserted). On top, with a registered `Client`:
`allocate` (evicting from the daemon when short), `prefill` (write the pattern, insert,
free what the cache did not take) and `load` (load back what the host holds, wait for
the acks, verify every byte).

Who builds on it: `tests/service` (directly), the soak's `ChaosEngine` (random steps
through daemon faults), the ops tests' `RawEngine` (its device side only: it speaks raw
gRPC on purpose, like an engine without the Python client), and test_cuda_e2e's
`GpuEngine` (CUDA buffers). `tests/gpu/ipc_engine.py` stays apart on purpose: an engine
process for data-path tests without a daemon, whose bytes name their page, not tokens.
"""

import torch

from radixkv.client import Client
from radixkv.layout import KvLayout
from radixkv.sim.buffers import SimBuffers
from radixkv.sim.kv import KvPattern, page_keys
from radixkv.sim.pages import PagePool
from radixkv.types import InsertResult, Registration, pack

from .daemon import wait_for

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
PS = LAYOUT.page_size
RPC_TIMEOUT_S = 20.0


def prompt(i: int, pages: int = 8, page_size: int = PS) -> list[int]:
    """Tokens of prompt `i`: `pages` whole pages sharing no prefix with another i."""
    return [1000 * i + t for t in range(pages * page_size)]


class EngineDouble:
    """One engine: `num_pages` device pages of `layout` (`buffers`: shared memory, or
    CUDA tensors on `device` with backend "cuda"), the pattern KV over them (`kv`),
    their owners (`pool`), and after `register` its client (`client`) and the daemon's
    answer (`registration`). `close` ends the session and frees the buffers."""

    kv_salt = b""  # mixed into the pattern's keys: ranks of one engine hold different KV

    def __init__(self, layout: KvLayout = LAYOUT, num_pages: int = 128, backend: str = "shm", device: int = 0):
        self.layout = layout
        self.page_size = layout.page_size
        self.buffers = SimBuffers.create(layout, num_pages, backend, device)
        self.kv = KvPattern(layout, self.buffers.tensors, num_pages)
        self.pool = PagePool(num_pages)
        self.client: Client | None = None
        self.registration: Registration | None = None

    @classmethod
    def connect(cls, target: str, namespace: str = "model/tp0", *, num_pages: int = 128,
                layout: KvLayout = LAYOUT, **register) -> "EngineDouble":
        """A double registered on the daemon at `target` (register's keywords pass on)."""
        engine = cls(layout, num_pages)
        engine.register(Client(target, timeout=RPC_TIMEOUT_S), namespace, **register)
        return engine

    def register(self, client: Client, namespace: str, **options) -> Registration:
        """Register this engine's buffers through `client`, which the double then uses."""
        self.client = client
        self.registration = client.register(namespace, self.layout, self.buffers.specs, self.pool.num_pages,
                                            backend=self.buffers.backend, device=self.buffers.device, **options)
        return self.registration

    @property
    def shm_name(self) -> str:
        """The shared-memory segment's name (shm backend): /dev/shm/<name> until `close`."""
        return self.buffers.specs[0].handle.decode()

    def page_view(self, b: int) -> torch.Tensor:
        """Buffer `b` as uint8 [num_pages, chunk_bytes]: row p is device page p."""
        return self.buffers.tensors[b].view(torch.uint8).view(self.pool.num_pages, self.layout.chunk_bytes)

    def forget_cache(self) -> None:
        """The session was lost: every page is the engine's again."""
        self.pool = PagePool(self.pool.num_pages)

    # -- pages -------------------------------------------------------------------------

    def allocate(self, n: int, partial: bool = False) -> list[int] | None:
        """`n` pages (now in use), evicting from the daemon when short. None when they
        cannot be had; with `partial`, as many as could be had instead."""
        short = n - self.pool.num_free
        if short > 0:
            self.evict(short)
        if self.pool.can_allocate(n):
            return self.pool.allocate(n)
        return self.pool.allocate(self.pool.num_free) if partial else None

    def evict(self, num_pages: int) -> list[int]:
        """Ask the cache to free `num_pages` device pages; they are the engine's again."""
        freed = list(self.client.evict(num_pages).freed_pages)
        self.pool.from_cache(freed, "Evict")
        return freed

    # -- engine steps ------------------------------------------------------------------

    def prefill(self, tokens, extra_key: bytes = b"") -> InsertResult:
        """"Compute" every whole page of `tokens` (write its pattern) and insert it."""
        packed = pack(tokens)
        n = len(packed) // 4 // self.page_size
        pages = self.allocate(n)
        if pages is None:
            raise RuntimeError(f"{n} device pages wanted, {self.pool.num_free} free after evicting")
        self.write_kv(pages, packed, extra_key)
        result = self.client.insert(packed, pages, extra_key=extra_key)
        redundant = set(result.redundant_pages)
        self.pool.free(result.redundant_pages, "Insert redundant")
        self.pool.to_cache([p for p in pages if p not in redundant], "Insert")
        return result

    def prefill_to_host(self, prompts) -> None:
        """`prefill` each prompt, then wait until their host copies are made (write-through
        to host, the daemon's default)."""
        before = self.counters()["backed_up_bytes"]
        for tokens in prompts:
            self.prefill(tokens)
        want = before + sum(len(t) // self.page_size for t in prompts) * self.layout.page_bytes
        wait_for(lambda: self.counters()["backed_up_bytes"] >= want, RPC_TIMEOUT_S, "the host copies")

    def load(self, tokens) -> tuple[int, tuple[int, int]]:
        """Load back what the host holds of `tokens` and verify the device prefix:
        (tokens now on the device, (byte, chunk) mismatches over them). Raises
        AssertionError when a load-back failed."""
        packed = pack(tokens)
        [m] = self.client.match([packed])
        pages, n = list(m.device_pages), m.device_tokens
        if m.host_tokens:
            given = self.allocate(m.host_tokens // self.page_size)
            lb = self.client.load_back(m.host_node, given)
            unused = set(lb.unused_pages)
            self.pool.free(lb.unused_pages, "LoadBack unused")
            self.pool.to_cache([p for p in given if p not in unused], "LoadBack used")
            outcomes = self.client.wait([lb.transfer, *lb.depends_on], timeout=RPC_TIMEOUT_S)
            assert all(o.ok for o in outcomes.values()), outcomes
            pages, n = list(lb.device_pages), lb.device_tokens
        return n, self.verify(packed[: n * 4], pages)

    def write_kv(self, pages: list[int], packed: bytes, extra_key: bytes = b"") -> None:
        """"Compute" the KV of `packed`'s whole pages into `pages`."""
        self.kv.write(pages, page_keys(packed, self.page_size, extra_key + self.kv_salt)[: len(pages)])

    def verify(self, packed: bytes, pages: list[int], extra_key: bytes = b"") -> tuple[int, int]:
        """(byte, chunk) mismatches of `pages` against the pattern of `packed` tokens."""
        return self.kv.mismatches(pages, page_keys(packed, self.page_size, extra_key + self.kv_salt)[: len(pages)])

    def counters(self) -> dict:
        """The first namespace's counters, from Stats."""
        return dict(self.client.stats().namespaces[0].counters)

    def close(self) -> None:
        """End the session (if any), then free the buffers."""
        if self.client is not None:
            self.client.close()
        self.buffers.close()


__all__ = ["LAYOUT", "PS", "EngineDouble", "prompt"]
