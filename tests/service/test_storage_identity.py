"""Which stored pages a namespace may read: the storage keys name the model and the KV
bytes a page holds, so a store shared by many namespaces and daemons never hands one
engine pages whose bytes mean something else to it.

A tensor-parallel engine's host page holds every rank's shard, in rank order, and is
stored whole under keys that name the rank count: an engine of the same model with
another tensor-parallel size (whose page holds the heads in another order) never reads
it, and the same engine on another daemon gets each rank's own bytes back.

A managed-device engine whose buffers split a page otherwise than its layout's own way
(one buffer per layer instead of K and V apart) lays the same host page out in another
byte order: its keys name that split, so neither engine reads the other's pages, in
another namespace or after the namespace that refused the other was dropped.
"""

import pytest

from radixkv import Client, errors
from radixkv.kvbuffers import BufferSpec, ShmKvBuffers
from radixkv.types import pack
from tests.support.daemon import wait_for
from tests.support.engine import PS, EngineDouble, prompt
from tests.support.ranked_engine import RankedEngine

DEADLINE_S = 20.0


def test_a_tensor_parallel_page_is_read_only_by_an_engine_of_its_rank_count(daemon_factory, tmp_path):
    store = ("--storage", f"file://{tmp_path}/pages", "--storage-policy", "write_through")
    a, b = daemon_factory(*store), daemon_factory(*store)
    writer, reader = RankedEngine.connect(a.target, "llama"), RankedEngine.connect(b.target, "llama")
    single = EngineDouble.connect(b.target, "llama-tp1", model="llama")
    try:
        writer.driver.prefill(prompt(1))
        wait_for(lambda: writer.driver.counters()["stored_tokens"] == 8 * PS, DEADLINE_S, "the group's store")
        [m] = single.client.match([prompt(1)], include_storage=True)
        assert m.storage_tokens == 0, "an unsharded engine would read heads in another order"

        [m] = reader.driver.client.match([prompt(1)], include_storage=True)
        assert m.storage_tokens == 8 * PS
        assert reader.driver.client.prefetch(prompt(1), policy="wait_complete")[-1].state == "done"
        assert reader.driver.load(prompt(1)) == (8 * PS, (0, 0)), "a rank got bytes that are not its own"
    finally:
        for engine in (writer, reader, single):
            engine.close()


def test_a_rank_is_checked_when_it_registers(daemon_factory):
    d = daemon_factory()
    with pytest.raises(errors.InvalidArgument, match="tp_rank 2 out of range 0..1"):
        EngineDouble.connect(d.target, "llama", tp_rank=2, tp_size=2)
    first = EngineDouble.connect(d.target, "llama", tp_rank=0, tp_size=2, instance="a")
    first.close()
    with pytest.raises(errors.FailedPrecondition, match="shared by tp_size 2 tensor-parallel ranks"):
        EngineDouble.connect(d.target, "llama", tp_rank=0, tp_size=4, instance="b")


def _one_buffer_per_layer(buffers: ShmKvBuffers, num_pages: int) -> list[BufferSpec]:
    """`buffers`' memory seen as one buffer per layer, a page holding that layer's K and V
    together (as a CPU attention backend lays them out)."""
    layout = buffers.layout
    layer = 2 * num_pages * layout.chunk_bytes
    return [BufferSpec(buffers.name.encode(), i * layer, layer, 2 * layout.chunk_bytes, 2 * layout.chunk_bytes)
            for i in range(layout.num_layers)]


def test_an_engine_splitting_pages_otherwise_never_reads_stored_pages(daemon_factory, tmp_path):
    d = daemon_factory("--storage", f"file://{tmp_path}/pages", "--storage-policy", "write_through")
    writer = EngineDouble.connect(d.target, "kv-apart", model="llama")
    layout, n = writer.layout, 64
    memory = ShmKvBuffers.create(layout, n)
    reader = Client(d.target)
    same_split = EngineDouble.connect(d.target, "kv-apart-too", model="llama")
    try:
        writer.prefill(prompt(1))
        wait_for(lambda: writer.counters()["stored_tokens"] == 8 * PS, DEADLINE_S, "the write-through store")
        [m] = same_split.client.match([prompt(1)], include_storage=True)
        assert m.storage_tokens == 8 * PS, "an engine of the usual split keeps reading the store"

        reader.register("per-layer", layout, _one_buffer_per_layer(memory, n), n, model="llama")
        [m] = reader.match([pack(prompt(1))], include_storage=True)
        assert m.storage_tokens == 0, "pages of the K/V-apart order were offered to a per-layer engine"
        reader.close()

        writer.close()  # the same namespace, dropped: its refusal of the other split is forgotten
        reader = Client(d.target)
        reader.drop_namespace("kv-apart")
        reader.register("kv-apart", layout, _one_buffer_per_layer(memory, n), n, model="llama")
        [m] = reader.match([pack(prompt(1))], include_storage=True)
        assert m.storage_tokens == 0
    finally:
        for engine in (writer, same_split):
            engine.close()
        reader.close()
        memory.close()


def test_a_namespace_registered_without_a_model_is_warned_about_when_storage_is_on(daemon_factory, tmp_path):
    d = daemon_factory("--storage", f"file://{tmp_path}/pages")
    named = EngineDouble.connect(d.target, "named", model="llama")
    unnamed = EngineDouble.connect(d.target, "llama/tp0")
    try:
        wait_for(lambda: "event=namespace.no_model namespace=llama/tp0" in d.log(), DEADLINE_S, "the warning")
        assert "event=namespace.no_model namespace=named" not in d.log()
    finally:
        named.close()
        unnamed.close()
