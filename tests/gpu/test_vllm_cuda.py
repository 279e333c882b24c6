"""The vLLM connector's CUDA path: vLLM-shaped KV views on the GPU, exported by IPC handle.

CUDA tensors in vLLM's FlashAttention layout (`[2, num_blocks, block_size, heads,
head_dim]` per layer, all layers views of one allocation as vLLM makes them) are
registered through the connector's own registration code (`register_worker`: backend
"cuda", the GPU by UUID, K and V halves as two buffers per layer) with a real daemon.
Blocks written on the GPU are saved (the daemon's copy ordered after them by an engine
event), looked up by a scheduler session, and loaded into other blocks (vLLM's stream
waiting on the load's per-layer events): the bytes come back exactly, and blocks the
load was not given stay untouched. FlashInfer (`[num_blocks, 2, ...]`, one buffer per
layer) goes the same way. Needs no vLLM install: the registration code does not import it.
"""

import pytest
import torch

from radixkv.client import Client
from radixkv.vllm.config import ConnectorConfig
from radixkv.vllm.daemon import DaemonAdapter
from radixkv.vllm.layouts import describe_views
from radixkv.vllm.registration import register_worker
from tests.vllm.scheduler_session import SchedulerSession

pytestmark = pytest.mark.gpu

BLOCKS, LAYERS, HEADS, TOKENS, HEAD = 64, 4, 2, 16, 128
HOST_FLAGS = ("--host-pool-size", "64MiB")


def vllm_views(device: int, kind: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(allocation, per-layer bf16 views of it) as vLLM's GPU worker makes them: one int8
    allocation, each layer a view in the attention backend's shape."""
    per_layer = 2 * BLOCKS * TOKENS * HEADS * HEAD * 2
    raw = torch.zeros(LAYERS * per_layer, dtype=torch.int8, device=f"cuda:{device}")
    shape = (2, BLOCKS, TOKENS, HEADS, HEAD) if kind == "flash_attention" else (BLOCKS, 2, TOKENS, HEADS, HEAD)
    views = {f"model.layers.{i}.self_attn.attn":
             raw[i * per_layer:(i + 1) * per_layer].view(torch.bfloat16).view(shape) for i in range(LAYERS)}
    return raw, views


SLOW_CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s of GPU clock


def block(view: torch.Tensor, kind: str, i: int) -> torch.Tensor:
    """Block i of one layer, K and V stacked (a copy)."""
    return torch.stack([view[0, i], view[1, i]]) if kind == "flash_attention" else view[i].clone()


@pytest.mark.parametrize("kind", ["flash_attention", "flash_infer"])
def test_vllm_cuda_kv_saves_and_loads_back_exactly(gpu_daemon, device, kind):
    d = gpu_daemon(*HOST_FLAGS)
    raw, views = vllm_views(device, kind)
    config = ConnectorConfig(target=d.target, namespace=f"vllm-cuda-{kind}", timeout_s=60.0)
    worker = DaemonAdapter(config, engine="test worker")
    scheduler = None
    try:
        register_worker(worker, views, TOKENS)
        assert worker.cuda_device == device
        layout = describe_views({k: v.cpu() for k, v in views.items()}, TOKENS, lambda n, t: (b"", 0)).layout
        scheduler = SchedulerSession(config, layout)
        gen = torch.Generator(device=f"cuda:{device}").manual_seed(0)
        # The writes queue behind ~0.1 s of GPU work, far longer than the Insert RPC: a save
        # that did not wait on the engine event would read the blocks before they are written.
        torch.cuda._sleep(SLOW_CYCLES)
        for v in views.values():  # vLLM's forward writing blocks 1..3, on the current stream
            v.copy_(torch.randn(v.shape, generator=gen, device=v.device, dtype=torch.float32).to(v.dtype))
        written = {name: [block(v, kind, i) for i in (1, 2, 3)] for name, v in views.items()}
        untouched = {name: block(v, kind, 9) for name, v in views.items()}
        tokens = torch.arange(7, 7 + 3 * TOKENS, dtype=torch.int32).numpy().tobytes()
        # No synchronize: the engine event orders it, as the connector's saves pass it (saves.py).
        transfer = worker.save(tokens, [1, 2, 3], worker.step_event())
        assert transfer and worker.done([transfer], timeout=None) == {transfer}
        for v in views.values():
            (v[:, 1:4] if kind == "flash_attention" else v[1:4]).zero_()  # vLLM reuses the blocks
        [hit] = scheduler.lookup([tokens])
        assert hit.tokens == 3 * TOKENS
        assert worker.load(hit.node, [20, 21, 22], 0, hit.lease) == 3
        scheduler.release([hit.lease])
        for name, v in views.items():  # read on vLLM's stream, after the load's events
            for got_at, want in zip((20, 21, 22), written[name]):
                assert torch.equal(block(v, kind, got_at), want), f"{name} block {got_at}"
            assert torch.equal(block(v, kind, 9), untouched[name])
        with Client(d.target) as c:
            [ns] = c.stats(config.namespace).namespaces
            assert ns.device_pages_held == 0 and c.check_invariants(config.namespace) == []
    finally:
        if scheduler is not None:
            scheduler.close()
        worker.close()
    del raw


def test_vllm_cuda_loads_are_waited_layer_by_layer(gpu_daemon, device):
    """A load answered once queued (as the connector sends them on CUDA), its per-layer
    events waited one layer at a time, as vLLM's attention layers ask (`LayerWaits`):
    each layer's blocks read right after its own wait hold the saved bytes, nothing is
    left for the step's end, and the load settles as copied after the "forward"."""
    from radixkv.vllm.layer_waits import LayerWaits
    kind = "flash_attention"
    d = gpu_daemon(*HOST_FLAGS)
    raw, views = vllm_views(device, kind)
    config = ConnectorConfig(target=d.target, namespace="vllm-cuda-layerwise", timeout_s=60.0)
    worker = DaemonAdapter(config, engine="test worker")
    scheduler = None
    try:
        register_worker(worker, views, TOKENS)
        layout = describe_views({k: v.cpu() for k, v in views.items()}, TOKENS, lambda n, t: (b"", 0)).layout
        scheduler = SchedulerSession(config, layout)
        waits = LayerWaits(views, worker.wait_loaded)
        for name in views:  # a forward that asks for every layer: waits go layer by layer
            waits.layer_begins(name)
        assert waits.step_over() == set() and waits.layerwise
        gen = torch.Generator(device=f"cuda:{device}").manual_seed(1)
        for v in views.values():
            v.copy_(torch.randn(v.shape, generator=gen, device=v.device, dtype=torch.float32).to(v.dtype))
        written = {name: [block(v, kind, i) for i in (1, 2, 3)] for name, v in views.items()}
        tokens = torch.arange(11, 11 + 3 * TOKENS, dtype=torch.int32).numpy().tobytes()
        transfer = worker.save(tokens, [1, 2, 3], worker.step_event())
        assert transfer and worker.done([transfer], timeout=None) == {transfer}
        [hit] = scheduler.lookup([tokens])
        # The load's copy waits for the engine event behind ~0.1 s of vLLM's GPU work: the
        # reads below, queued right after that work, would race the copy without the waits.
        torch.cuda._sleep(SLOW_CYCLES)
        pending = worker.begin_load(hit.node, [30, 31, 32], 0, hit.lease, queued=True)
        assert worker.finish_load(pending, lambda events: waits.loaded("req", events)) == 3
        assert waits.holding and pending.transfer
        for name, v in views.items():
            waits.layer_begins(name)
            for got_at, want in zip((30, 31, 32), written[name]):
                assert torch.equal(block(v, kind, got_at), want), f"{name} block {got_at}"
        assert not waits.holding and waits.step_over() == set()
        assert worker.settle_loads([pending.transfer]) == (set(), set())
        scheduler.release([hit.lease])
    finally:
        if scheduler is not None:
            scheduler.close()
        worker.close()
    del raw
