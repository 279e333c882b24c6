"""A tensor-parallel engine on one managed-device namespace, on CUDA: two ranks (on one
GPU here), each with buffers of its own holding its own KV, rank 0 making the calls. What
the host tier gives back to each rank is that rank's own bytes, and every copy took the
zero-copy view of the pinned pool (a rank's slice of it), not the page-by-page path."""

import pytest
import torch

from tests.support.engine import PS, prompt
from tests.support.ranked_engine import RankedEngine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_every_rank_gets_its_own_kv_back_on_cuda(gpu_daemon, device, policy):
    d = gpu_daemon()
    engine = RankedEngine(tp_size=2, backend="cuda", device=device)
    try:
        engine.register(d.target, "gpu-tp", write_policy=policy)
        engine.driver.prefill(prompt(1))
        engine.driver.prefill(prompt(2))
        engine.driver.evict(engine.driver.pool.num_pages)  # write-back copies out here; device copies gone
        for rank in engine.ranks:
            for b in range(rank.layout.num_buffers):
                rank.page_view(b).fill_(0)
        torch.cuda.synchronize()
        for i in (1, 2):
            assert engine.driver.load(prompt(i)) == (8 * PS, (0, 0)), f"prompt {i}: a rank got other bytes"
        assert engine.driver.client.check_invariants() == []
    finally:
        engine.close()
    assert "chunk by chunk" not in d.log(), "a rank's copies left the zero-copy path"
