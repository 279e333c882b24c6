"""Which stored pages a namespace may read: the storage keys name the model and the KV
bytes a page holds, so a store shared by many namespaces and daemons never hands one
engine pages whose bytes mean something else to it.

A tensor-parallel engine's host page holds every rank's shard, in rank order, and is
stored whole under keys that name the rank count: an engine of the same model with
another tensor-parallel size (whose page holds the heads in another order) never reads
it, and the same engine on another daemon gets each rank's own bytes back.
"""

import pytest

from radixkv import errors
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
