"""Layer-by-layer waits for a step's loads (`LayerWaits`): vLLM's forward reads layer i of
the loaded blocks only after the daemon's copy of layer i, not after every layer's.

On CUDA a LoadBack answers once its copy is queued, with one IPC event per layer (the
daemon records event i after layer i's pages are in place). Waiting for all of them before
the forward holds the first layer back until the last one is copied; vLLM instead calls
the connector's `wait_for_layer_load(layer_name)` as each attention layer begins, so the
stream can wait there for that layer's events alone while later layers still copy. Layer
i of the namespace is the i-th view vLLM registered (`layouts.describe_views`).

A wait that vLLM never asks for would let the forward read blocks before their bytes
arrived, so the waits go layer by layer only once a forward has asked for every registered
layer by name (before that a load's events are all waited when its answer comes). A step
that ends with events nobody waited for (a layer that did not ask) waits for them then,
names the loads whose forward may have read early, and goes back to whole waits for good:
the connector reports those loads failed, so vLLM recomputes their blocks and nothing is
saved from that forward.

Pure bookkeeping: `wait(handles)` is the only call into CUDA (`DaemonAdapter.wait_loaded`);
on shared memory loads have no events and nothing is ever held.
"""

from collections.abc import Callable, Iterable


class LayerWaits:
    """One worker's waits, for the registered layer `names` in namespace order. `wait`
    makes vLLM's current stream wait for a list of event handles. Used from vLLM's worker
    thread only (no lock)."""

    def __init__(self, names: Iterable[str], wait: Callable[[list[bytes]], None]):
        self._index = {name: i for i, name in enumerate(names)}
        self._wait = wait
        self._held: list[list[tuple[str, bytes]]] = [[] for _ in self._index]  # per layer: (request, event) not yet waited
        self._asked: set[int] = set()  # layers whose wait vLLM asked for since the last step_over
        self.layerwise = False  # learned: vLLM asks for every layer's wait in a forward
        self.gave_up = False  # a forward did not ask for some layer: whole waits from then on

    @property
    def holding(self) -> bool:
        return any(self._held)

    def loaded(self, req_id: str, layer_events: Iterable[bytes]) -> None:
        """The answer of `req_id`'s load came with these per-layer events: hold each for its
        layer's wait, or (not yet layer by layer, or not one event per layer) wait for all now."""
        events = list(layer_events)
        if not events:
            return
        if not self.layerwise or len(events) != len(self._held):
            self._wait(events)
            return
        for held, event in zip(self._held, events):
            held.append((req_id, event))

    def layer_begins(self, name: str) -> None:
        """vLLM's attention layer `name` is about to read its KV: wait for that layer's held
        events. A name radixkv did not register (another KV cache group) is no layer of its loads."""
        i = self._index.get(name)
        if i is None:
            return
        self._asked.add(i)
        if self._held[i]:
            self._wait([event for _, event in self._held[i]])
            self._held[i] = []

    def step_over(self) -> set[str]:
        """The forward is queued: wait for whatever is still held (later kernels must find
        the bytes in place) and return the requests whose loads had events no layer waited
        for (their forward may have read early; empty when all went well). Learns, from
        the layers asked for since the last call, whether waits can go layer by layer.
        Idempotent until the next forward."""
        rest = [pair for held in self._held for pair in held]
        if rest:
            self._wait([event for _, event in rest])
        self._held = [[] for _ in self._index]
        early = {req_id for req_id, _ in rest}
        if early:
            self.layerwise, self.gave_up = False, True
        elif self._asked and len(self._asked) == len(self._index) and not self.gave_up:
            self.layerwise = True
        self._asked = set()
        return early


__all__ = ["LayerWaits"]
