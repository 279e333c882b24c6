"""Engine-managed namespaces against a real daemon process, through `radixkv.Client`:
two engine instances share one namespace's host tier, tensor-parallel ranks save and load
their own shards, and an injected load fault reaches the engine as a failed load."""

import dataclasses

import pytest
from radixkv import Client
from radixkv.kvbuffers import BufferSpec, ShmKvBuffers
from radixkv.layout import KvLayout
from radixkv.types import pack

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", page_size=4)
PAGES = 16
CHUNK = LAYOUT.chunk_bytes


def tokens(first: int, pages: int) -> bytes:
    return pack(range(first, first + pages * LAYOUT.page_size))


class Rank:
    """One engine rank: its KV segment (described FlashInfer-style: per layer K and V
    pages alternate, page_stride 2 chunks) and its ENGINE session."""

    def __init__(self, target: str, namespace: str, *, tp_rank: int = 0, tp_size: int = 1, instance: str = "a"):
        self.buffers = ShmKvBuffers.create(LAYOUT, PAGES)
        handle, layer = self.buffers.name.encode(), 2 * PAGES * CHUNK
        self.specs = [BufferSpec(handle, l * layer + j * CHUNK, layer - j * CHUNK, 2 * CHUNK, CHUNK)
                      for l in range(LAYOUT.num_layers) for j in range(2)]
        self.client = Client(target, timeout=10)
        self.client.register(namespace, LAYOUT, self.specs, PAGES, device_tier="engine_managed", role="engine",
                             tp_rank=tp_rank, tp_size=tp_size, instance=instance, engine=f"rank {tp_rank}")
        self.rank = tp_rank

    def _page(self, spec: BufferSpec, p: int):
        return self.buffers._bytes[spec.offset + p * spec.page_stride:][:CHUNK]

    def fill(self, pages: list[int], seed: int) -> None:
        for b, spec in enumerate(self.specs):
            for i, p in enumerate(pages):
                self._page(spec, p).fill_((seed + 7 * b + 13 * i + 31 * self.rank) % 251)

    def read(self, pages: list[int]) -> list[bytes]:
        return [bytes(self._page(spec, p).numpy()) for p in pages for spec in self.specs]

    def save(self, prompt: bytes, pages: list[int]) -> None:
        result = self.client.insert(prompt, pages, async_=True)
        if result.transfer:
            assert self.client.wait([result.transfer], timeout=10)[result.transfer].ok

    def close(self) -> None:
        self.client.close()
        self.buffers.close()


def scheduler(target: str, namespace: str, tp_size: int = 1) -> Client:
    c = Client(target, timeout=10)
    c.register(namespace, LAYOUT, [], 0, device_tier="engine_managed", role="scheduler", tp_size=tp_size)
    return c


def test_a_second_engine_instance_hits_and_loads_what_the_first_saved(daemon):
    a, b = Rank(daemon, "m", instance="a"), Rank(daemon, "m", instance="b")
    sched = scheduler(daemon, "m")
    try:
        prompt = tokens(0, 3)
        a.fill([1, 2, 3], seed=3)
        a.save(prompt, [1, 2, 3])
        (hit,) = sched.match([prompt], lease=True)
        assert (hit.device_tokens, hit.host_tokens, hit.complete_tokens) == (0, 12, 12)
        load = b.client.load_back(hit.host_node, [8, 9, 10], lease=hit.lease)
        assert load.loaded_tokens == 12
        assert b.client.wait([load.transfer], timeout=10)[load.transfer].ok
        sched.release([hit.lease])
        assert b.read([8, 9, 10]) == a.read([1, 2, 3]), "instance b holds instance a's bytes"
        assert sched.check_invariants() == []
    finally:
        for x in (a, b):
            x.close()
        sched.close()


def test_tensor_parallel_ranks_complete_a_prefix_together_and_load_their_own_shards(daemon):
    r0, r1 = Rank(daemon, "tp", tp_rank=0, tp_size=2), Rank(daemon, "tp", tp_rank=1, tp_size=2)
    sched = scheduler(daemon, "tp", tp_size=2)
    try:
        prompt = tokens(50, 2)
        for r in (r0, r1):
            r.fill([0, 1], seed=11)
        r0.save(prompt, [0, 1])
        (half,) = sched.match([prompt])
        assert (half.host_tokens, half.complete_tokens) == (8, 0), "a prefix without rank 1's shard is no hit"
        r1.save(prompt, [0, 1])
        (hit,) = sched.match([prompt], lease=True)
        assert hit.complete_tokens == 8
        for r in (r0, r1):
            load = r.client.load_back(hit.host_node, [5, 6], lease=hit.lease)
            assert r.client.wait([load.transfer], timeout=10)[load.transfer].ok
            assert r.read([5, 6]) == r.read([0, 1]), f"rank {r.rank} loaded its own shard"
        assert r0.read([5]) != r1.read([5])
        sched.release([hit.lease])
    finally:
        for x in (r0, r1):
            x.close()
        sched.close()


@pytest.mark.parametrize("flags", [("--fault-fail-loads", "1")])
def test_an_injected_load_fault_is_a_failed_load_with_its_pages(daemon_factory, flags):
    target = daemon_factory(*flags).target
    eng = Rank(target, "f")
    try:
        prompt = tokens(0, 2)
        eng.fill([0, 1], seed=1)
        eng.save(prompt, [0, 1])
        (hit,) = eng.client.match([prompt], lease=True)
        load = eng.client.load_back(hit.host_node, [4, 5], lease=hit.lease)
        outcome = eng.client.wait([load.transfer], timeout=10)[load.transfer]
        assert not outcome.ok and "injected fault" in outcome.reason
        assert list(outcome.failed_pages) == [4, 5]
        eng.client.release([hit.lease])
        assert eng.client.check_invariants() == []
    finally:
        eng.close()


def test_a_restarted_daemon_serves_every_shard_from_file_storage(daemon_factory, tmp_path):
    flags = ("--storage", f"file://{tmp_path}", "--storage-policy", "write_through")
    first = daemon_factory(*flags)
    prompt = tokens(7, 2)
    r0, r1 = save_shards(first.target, "st", prompt, seed=21)
    for r in (r0, r1):
        r.client.close()
    assert first.stop() == 0
    target = daemon_factory(*flags).target
    sched = scheduler(target, "st", tp_size=2)
    fresh = [Rank(target, "st", tp_rank=r, tp_size=2) for r in (0, 1)]
    try:
        (miss,) = sched.match([prompt], include_storage=True)
        assert (miss.host_tokens, miss.storage_tokens) == (0, 8)
        assert sched.prefetch(prompt, policy="wait_complete")[-1].state == "done"
        (hit,) = sched.match([prompt], lease=True)
        assert hit.complete_tokens == 8, "pages fetched from storage hold every rank's shard"
        for old, new in zip((r0, r1), fresh):
            load = new.client.load_back(hit.host_node, [3, 4], lease=hit.lease)
            assert new.client.wait([load.transfer], timeout=10)[load.transfer].ok
            assert new.read([3, 4]) == old.read([0, 1]), f"rank {new.rank}'s shard came back from storage"
        sched.release([hit.lease])
    finally:
        for r in (*fresh, r0, r1):
            r.buffers.close()
        for r in fresh:
            r.client.close()
        sched.close()


def test_the_model_at_another_tensor_parallel_size_does_not_read_those_shards(daemon_factory, tmp_path):
    """A host page of two rank shards holds as many bytes as a page of the whole model
    (twice the heads) at tp_size 1, in another order: a daemon serving the model unsharded
    on the same storage must miss, not load rank 0's shard as heads 0-1 of layer 0."""
    flags = ("--storage", f"file://{tmp_path}", "--storage-policy", "write_through")
    prompt = tokens(7, 2)
    for r in save_shards(daemon_factory(*flags).target, "m", prompt, seed=5):
        r.close()
    whole = Client(daemon_factory(*flags).target, timeout=10)
    try:
        wide = dataclasses.replace(LAYOUT, num_kv_heads=2 * LAYOUT.num_kv_heads)
        whole.register("m", wide, [], 0, device_tier="engine_managed", role="scheduler", tp_size=1)
        (m,) = whole.match([prompt], include_storage=True)
        assert m.storage_tokens == 0
    finally:
        whole.close()


def save_shards(target: str, namespace: str, prompt: bytes, seed: int) -> list[Rank]:
    """Two tensor-parallel ranks that each saved their shard of `prompt` (pages 0 and 1),
    once the write-through store holds them; the caller closes them (their buffers keep
    what was saved)."""
    ranks = [Rank(target, namespace, tp_rank=r, tp_size=2) for r in (0, 1)]
    try:
        for r in ranks:
            r.fill([0, 1], seed=seed)
            r.save(prompt, [0, 1])
        sched = scheduler(target, namespace, tp_size=2)
        wait_for_stored(sched, namespace, 2 * LAYOUT.page_size)
        sched.close()
    except BaseException:
        for r in ranks:
            r.close()
        raise
    return ranks


def wait_for_stored(client: Client, namespace: str, tokens: int) -> None:
    """Until the namespace counts `tokens` stored tokens (the write-through store runs after the save)."""
    from tests.support.daemon import wait_for

    def stored():
        (ns,) = client.stats(namespace).namespaces
        return ns.counters["stored_tokens"] >= tokens
    wait_for(stored, 10, f"{tokens} tokens stored")
