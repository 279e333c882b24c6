"""Layer-by-layer waits for loads (radixkv.vllm.layer_waits): vLLM's attention layer i
waits only for the daemon's copy of layer i, once vLLM is seen to ask for every layer, and
a load whose forward did not wait for some layer counts as failed.

The bookkeeping is tested with the event handles a CUDA LoadBack answers with (opaque
bytes here: `wait` records what the stream would wait for); that real vLLM asks for every
layer it registered, by the names it registered, is tested with real vLLM on CPU, where
loads carry no events but the asking is the same."""

from radixkv.vllm.layer_waits import LayerWaits

from tests.vllm.engines import generate, prompt

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn", "model.layers.2.self_attn.attn")


def events(load: str) -> list[bytes]:
    return [f"{load}:{i}".encode() for i in range(len(LAYERS))]


class Stream:
    """What vLLM's stream was made to wait for, in order."""

    def __init__(self):
        self.waited: list[list[bytes]] = []

    def wait(self, handles: list[bytes]) -> None:
        self.waited.append(list(handles))


def forward(waits: LayerWaits, layers=LAYERS) -> set[str]:
    for name in layers:
        waits.layer_begins(name)
    return waits.step_over()


def test_loads_wait_for_all_layers_until_a_forward_asked_for_every_layer():
    stream = Stream()
    waits = LayerWaits(LAYERS, stream.wait)
    waits.loaded("a", events("a"))
    assert stream.waited == [events("a")]  # nothing learned yet: the whole load, at once
    assert forward(waits, LAYERS[:2]) == set() and not waits.layerwise  # one layer not asked for
    assert forward(waits) == set() and waits.layerwise


def test_each_layer_waits_for_its_own_events_of_every_load():
    stream = Stream()
    waits = LayerWaits(LAYERS, stream.wait)
    forward(waits)
    waits.loaded("a", events("a"))
    waits.loaded("b", events("b"))
    assert stream.waited == [] and waits.holding
    waits.layer_begins(LAYERS[0])
    assert stream.waited == [[b"a:0", b"b:0"]]
    waits.layer_begins("mtp.layers.0.attn")  # not a registered layer: waits for nothing
    for name in LAYERS[1:]:
        waits.layer_begins(name)
    assert stream.waited == [[b"a:0", b"b:0"], [b"a:1", b"b:1"], [b"a:2", b"b:2"]]
    assert waits.step_over() == set() and waits.step_over() == set() and not waits.holding
    assert waits.layerwise


def test_a_layer_that_never_waited_fails_its_loads_and_ends_layer_by_layer_waits():
    stream = Stream()
    waits = LayerWaits(LAYERS, stream.wait)
    forward(waits)
    waits.loaded("a", events("a"))
    waits.layer_begins(LAYERS[0])
    waits.layer_begins(LAYERS[2])
    assert waits.step_over() == {"a"}  # layer 1 may have been read before its copy
    assert stream.waited[-1] == [b"a:1"]  # waited for at the step's end all the same
    assert not waits.layerwise and not waits.holding
    forward(waits)  # asked for every layer again: whole waits stay
    waits.loaded("b", events("b"))
    assert stream.waited[-1] == events("b") and not waits.layerwise


def test_a_load_without_one_event_per_layer_is_waited_whole():
    stream = Stream()
    waits = LayerWaits(LAYERS, stream.wait)
    forward(waits)
    waits.loaded("a", [])  # shared memory: nothing to wait for
    waits.loaded("b", events("b")[:2])
    assert stream.waited == [[b"b:0", b"b:1"]] and not waits.holding


def test_real_vllm_asks_for_every_registered_layer_by_name(engines, daemon):
    """What lets CUDA loads go layer by layer: vLLM's forward asks the connector for
    every layer it registered, under the same names, in a step that loads."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    p = prompt(512, seed=11)
    first = engines.start(daemon.target)
    generate(first, [p])
    engines.stop(first)
    llm = engines.start(daemon.target)  # vLLM's own prefix cache is empty: a host hit
    [warm] = generate(llm, [p])
    assert warm.cached_tokens == 384
    layers = get_kv_transfer_group()._loads._layers
    assert layers.layerwise and not layers.gave_up and not layers.holding


def test_loads_wait_whole_where_vllm_may_replay_a_forward_as_a_full_cuda_graph():
    """A forward replayed as a FULL CUDA graph calls no wait_for_layer_load: a worker on
    such a config never waits layer by layer (its loads would otherwise count as failed)."""
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode

    from radixkv.vllm.connector import _full_cuda_graphs

    def config(mode, device="cuda"):
        return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=mode),
                               device_config=SimpleNamespace(device=SimpleNamespace(type=device)))

    assert _full_cuda_graphs(config(CUDAGraphMode.FULL_AND_PIECEWISE))  # vLLM's default on CUDA
    assert _full_cuda_graphs(config(CUDAGraphMode.FULL_DECODE_ONLY))
    assert not _full_cuda_graphs(config(CUDAGraphMode.PIECEWISE))
    assert not _full_cuda_graphs(config(CUDAGraphMode.NONE))
    assert not _full_cuda_graphs(config(CUDAGraphMode.FULL_AND_PIECEWISE, device="cpu"))
