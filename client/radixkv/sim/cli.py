"""radixkv-sim: run a seeded workload against a daemon and verify every byte.

    radixkv-sim --target unix:///tmp/x/radixkv.sock --workload multiturn --requests 300
    radixkv-sim --backend cuda --device 0 ...   # KV buffers as CUDA tensors on cuda:0

Prints progress, then a summary whose last line is "<N> byte mismatches". Exits 0 when
the run was clean, 1 on any defect (mismatch, accounting error, invariant violation,
stall), 2 when the daemon refused or could not be reached.
"""

import argparse
import os
import uuid
import sys
from dataclasses import dataclass

import torch

from ..client import DEFAULT_TARGET, Client
from ..errors import RadixKVError
from ..layout import DTYPE_SIZES, KV_FORMATS, KvLayout
from .buffers import SIM_BACKENDS, SimBuffers
from .engine import Engine
from .report import Report
from .workload import WORKLOADS, MultiTurn, SharedPrefix, Workload


@dataclass(frozen=True)
class SimConfig:
    """Every knob of a run; the CLI flags read their defaults from here."""

    target: str = DEFAULT_TARGET
    namespace: str = "radixkv-sim"
    workload: str = "multiturn"
    requests: int = 200
    clients: int = 8
    rounds: int = 0          # multiturn: 0 = until --requests
    max_context: int = 2048  # longest request/conversation (capped at half the device pool)
    groups: int = 4          # shared_prefix: distinct system prompts
    rate: float = 0.0        # Poisson arrivals per step (0: all arrive at once)
    batch: int = 8
    device_pages: int = 512
    host_pages: int = 0      # 0: the daemon's default
    layers: int = 2
    heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    dtype: str = "float16"
    kv_format: str = "mha"
    backend: str = "shm"     # "cuda": KV buffers are CUDA tensors on `device`, shared by IPC
    device: int = 0
    seed: int = 0
    write_policy: str = ""   # "": the daemon's default
    replace_existing: bool = False
    ready_timeout: float = 10.0
    progress_every: int = 100
    torch_threads: int = 1   # the KV work is tiny: more threads only add overhead (0: leave torch's)
    token: str = ""          # for a daemon started with --auth-token(-file)
    tp: int = 1              # tensor-parallel ranks: each registers its own buffers, rank 0 makes the calls


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def parse_args(argv=None) -> SimConfig:
    d = SimConfig()
    p = argparse.ArgumentParser(prog="radixkv-sim", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default=d.target, help="daemon address (unix:///path or host:port)")
    p.add_argument("--token", default=d.token,
                   help="the token of a daemon started with --auth-token or --auth-token-file")
    p.add_argument("--namespace", default=d.namespace, help="the namespace the simulated engine registers")
    p.add_argument("--workload", default=d.workload, choices=sorted(WORKLOADS),
                   help="multiturn chats, or requests sharing system prompts")
    p.add_argument("--requests", type=_positive, default=d.requests, help="requests to run in all")
    p.add_argument("--clients", type=_positive, default=d.clients, help="multiturn: concurrent chats")
    p.add_argument("--rounds", type=_non_negative, default=d.rounds, help="multiturn: rounds per chat (0: until --requests)")
    p.add_argument("--max-context", type=_positive, default=d.max_context,
                   help="longest request in tokens; multiturn chats start over past it (capped at half the device pool)")
    p.add_argument("--groups", type=_positive, default=d.groups, help="shared_prefix: distinct system prompts")
    p.add_argument("--rate", type=float, default=d.rate, help="Poisson arrivals per step (0: no waiting)")
    p.add_argument("--batch", type=_positive, default=d.batch, help="requests per scheduler step")
    p.add_argument("--device-pages", type=_positive, default=d.device_pages, help="the engine's KV pool, in pages")
    p.add_argument("--host-pages", type=_non_negative, default=d.host_pages, help="host pool pages (0: daemon default)")
    p.add_argument("--layers", type=_positive, default=d.layers, help="KV layout: layers")
    p.add_argument("--heads", type=_positive, default=d.heads, help="KV layout: KV heads")
    p.add_argument("--head-dim", type=_positive, default=d.head_dim, help="KV layout: head size")
    p.add_argument("--page-size", type=_positive, default=d.page_size, help="KV layout: tokens per page")
    p.add_argument("--dtype", default=d.dtype, choices=sorted(DTYPE_SIZES), help="KV layout: element type")
    p.add_argument("--kv-format", default=d.kv_format, choices=sorted(KV_FORMATS),
                   help="KV layout: K and V buffers per layer (mha) or one (mla)")
    p.add_argument("--backend", default=d.backend, choices=SIM_BACKENDS,
                   help="where the engine's KV buffers live: shared memory, or CUDA tensors (IPC)")
    p.add_argument("--device", type=int, default=d.device, help="CUDA device of the KV buffers (--backend cuda)")
    p.add_argument("--seed", type=int, default=d.seed, help="the workload's and the KV bytes' seed")
    p.add_argument("--write-policy", default=d.write_policy,
                   help="write_through, write_through_selective or write_back (empty: the daemon's)")
    p.add_argument("--replace-existing", action="store_true", help="take over the namespace from a live session")
    p.add_argument("--ready-timeout", type=float, default=d.ready_timeout, help="seconds to wait for the daemon")
    p.add_argument("--progress-every", type=_non_negative, default=d.progress_every,
                   help="print progress every N requests (0: every step)")
    p.add_argument("--tp", type=_positive, default=d.tp,
                   help="tensor-parallel ranks sharing one page table (SGLang's way): each registers its own "
                        "buffers on the namespace, every page is written and verified on every rank")
    p.add_argument("--torch-threads", type=_non_negative, default=d.torch_threads,
                   help="torch intra-op threads for this process (0: torch's default)")
    a = p.parse_args(argv)
    return SimConfig(**{k: getattr(a, k) for k in SimConfig.__dataclass_fields__})


def make_workload(c: SimConfig) -> Workload:
    """The configured workload; request sizes shrink to fit `max_context`, itself capped
    at half the device pool so that requests always fit beside the cache."""
    rate = c.rate or None
    limit = min(c.max_context, c.device_pages * c.page_size // 2)
    if c.workload == "shared_prefix":
        system, (suffix, answer) = _fit(limit, 256, (16, 128), (8, 64))
        return SharedPrefix(c.requests, c.seed, groups=c.groups, system_tokens=system,
                            suffix_tokens=suffix, answer_tokens=answer, rate=rate)
    system, (turn, answer) = _fit(limit, 48, (16, 96), (16, 96))
    return MultiTurn(c.requests, c.seed, clients=c.clients, rounds=c.rounds or None,
                     system_tokens=system, turn_tokens=turn, answer_tokens=answer,
                     max_context=limit, rate=rate)


def _fit(limit: int, first: int, *ranges: tuple[int, int]):
    """Scale a fixed length and (lo, hi) ranges down so first + every hi <= limit."""
    scale = min(1.0, limit / (first + sum(hi for _, hi in ranges)))

    def n(x: int) -> int:
        return max(1, int(x * scale))

    return n(first), [(n(lo), n(hi)) for lo, hi in ranges]


def run(c: SimConfig, out=sys.stdout) -> Report:
    """Register, run the workload, check the daemon's view; the session is closed and
    the device buffers (shared memory or CUDA tensors) released before returning. Sets
    torch's thread count for the whole process when `c.torch_threads` is non-zero.
    Raises RadixKVError when the daemon refuses or cannot be reached (the partial
    report, or None when nothing ran, is on the exception as `.report`), ValueError on
    a bad layout, workload or backend (`--backend cuda` without a GPU)."""
    layout = KvLayout(c.layers, c.heads, c.head_dim, c.dtype, c.page_size, c.kv_format)
    workload = make_workload(c)
    if c.torch_threads:
        torch.set_num_threads(c.torch_threads)
    buffers = [SimBuffers.create(layout, c.device_pages, c.backend, c.device) for _ in range(c.tp)]
    engine = None
    ranks: list[Client] = []  # ranks 1.. of a tensor-parallel engine, registered first
    try:
        with Client(c.target, token=c.token or None) as client:
            client.wait_ready(c.ready_timeout)
            group = dict(tp_size=c.tp, instance=uuid.uuid4().hex) if c.tp > 1 else {}
            for r in range(1, c.tp):
                ranks.append(Client(c.target, token=c.token or None))
                _register(ranks[-1], c, layout, buffers[r], tp_rank=r, **group)
            reg = _register(client, c, layout, buffers[0], **group)
            print(f"[sim] {c.namespace}: session {reg.session[:8]}, write policy {reg.write_policy}, "
                  f"{c.device_pages} device pages ({buffers[0]}{f' x {c.tp} ranks' if c.tp > 1 else ''}), "
                  f"{reg.host_pool_pages} host pages, {c.workload} x {c.requests}", file=out, flush=True)
            engine = Engine(client, layout, buffers[0].tensors, c.device_pages, max_batch=c.batch,
                            stream=buffers[0].stream, other_ranks=[b.tensors for b in buffers[1:]])
            engine.run(workload, progress=lambda r: print(r.progress(c.requests), file=out, flush=True),
                       progress_every=c.progress_every)
            engine.check_daemon(c.namespace)
            return engine.report
    except RadixKVError as e:
        e.report = engine.report if engine is not None else None
        raise
    finally:
        engine = None  # drop the engine's views of the buffers so the memory can go
        for rank in ranks:
            rank.close()
        for b in buffers:
            b.close()


def _register(client: Client, c: SimConfig, layout: KvLayout, buffers: SimBuffers, **rank):
    return client.register(c.namespace, layout, buffers.specs, c.device_pages, backend=c.backend,
                           device=buffers.device, write_policy=c.write_policy, host_pool_pages=c.host_pages,
                           replace_existing=c.replace_existing, engine=f"radixkv-sim pid {os.getpid()}", **rank)


def main(argv=None) -> int:
    c = parse_args(argv)
    try:
        report = run(c)
        code = 0 if report.ok else 1
    except RadixKVError as e:
        print(f"radixkv-sim: {e}", file=sys.stderr)
        report, code = e.report, 2
    except ValueError as e:  # a bad layout or workload setting
        print(f"radixkv-sim: {e}", file=sys.stderr)
        return 2
    if report is None:  # nothing ran
        return code
    for line in report.summary():
        print(line)
    return code


if __name__ == "__main__":
    sys.exit(main())
