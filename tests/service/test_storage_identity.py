"""Which stored pages a namespace may read: the storage keys name the model and the KV
bytes a page holds, so a store shared by many namespaces and daemons never hands one
engine pages whose bytes mean something else to it.

Managed-device engines of one model split over tensor-parallel ranks (one namespace and
session per rank, as SGLang runs) compute the same prompts, and every rank's page holds
other heads: each declares its rank (`tp_rank`, `tp_size`), and a rank never reads
another's pages (before: `model` alone named them, and rank 1 loaded rank 0's bytes).
"""

import pytest

from radixkv import errors
from tests.support.daemon import wait_for
from tests.support.engine import PS, EngineDouble, prompt

DEADLINE_S = 20.0


def test_tensor_parallel_ranks_of_one_model_never_read_each_others_pages(daemon_factory, tmp_path):
    d = daemon_factory("--storage", f"file://{tmp_path}/pages", "--storage-policy", "write_through")
    ranks = [EngineDouble.connect(d.target, f"llama/tp{r}", model="llama", tp_rank=r, tp_size=2) for r in (0, 1)]
    try:
        ranks[0].prefill(prompt(1))
        wait_for(lambda: ranks[0].counters()["stored_tokens"] == 8 * PS, DEADLINE_S, "rank 0's store")
        [m] = ranks[1].client.match([prompt(1)], include_storage=True)
        assert m.storage_tokens == 0, "rank 1 would load rank 0's heads"
        ranks[1].prefill(prompt(1))  # its own shard, stored under keys of its own (found stored before)
        wait_for(lambda: ranks[1].counters()["stored_tokens"] == 8 * PS, DEADLINE_S, "rank 1's store")
    finally:
        for engine in ranks:
            engine.close()


def test_a_rank_is_checked_when_it_registers(daemon_factory):
    d = daemon_factory()
    with pytest.raises(errors.InvalidArgument, match="tp_rank 2 out of range 0..1"):
        EngineDouble.connect(d.target, "llama/tp2", model="llama", tp_rank=2, tp_size=2)
    first = EngineDouble.connect(d.target, "llama/tp0", model="llama", tp_rank=0, tp_size=2)
    first.close()
    with pytest.raises(errors.FailedPrecondition, match="another tensor-parallel shard than tp_rank 1"):
        EngineDouble.connect(d.target, "llama/tp0", model="llama", tp_rank=1, tp_size=2)
