"""radixkv.sim: a simulated inference engine for tests and benchmarks.

It owns a device KV pool (shared memory, or CUDA tensors shared by IPC with
`--backend cuda`), registers with a daemon and runs seeded workloads like an SGLang
scheduler, writing deterministic KV bytes and verifying every byte it reads back.
`radixkv-sim` (radixkv.sim.cli) runs it from the command line.
"""

from .buffers import SimBuffers
from .engine import Engine
from .kv import KvPattern, page_keys
from .pages import PagePool
from .report import Report
from .workload import WORKLOADS, MultiTurn, Request, SharedPrefix, Workload

__all__ = [
    "Engine", "KvPattern", "MultiTurn", "PagePool", "Report", "Request", "SharedPrefix", "SimBuffers",
    "WORKLOADS", "Workload", "page_keys",
]
