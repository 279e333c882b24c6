"""Request messages built from Python values, shared by the sync and asyncio clients.

Each builder validates what the client can check on its own (types, non-negative
counts) and raises `InvalidArgument` before anything is sent; the daemon checks the rest.
"""

import os
from collections.abc import Iterable, Sequence

from radixkv.v1 import radixkv_pb2 as pb

from .errors import InvalidArgument
from .layout import KvLayout
from .types import Prompt, as_packed

# Channel options both clients use. Reconnect backoff is kept short so a client that
# starts before the daemon (wait_ready) connects soon after the socket appears.
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
# gRPC's "min_reconnect_backoff_ms" is the least time a connection attempt is given to
# finish its HTTP/2 handshake, not a wait between attempts (those follow the initial and
# max backoff). At 50 ms a daemon that had just started on a busy machine did not send
# its SETTINGS in time, attempt after attempt, and engines stayed without a session for
# seconds after it was ready. A refused connect (no daemon) fails at once whatever this is.
MIN_CONNECT_TIMEOUT_MS = 5000


def channel_options(max_message_bytes: int, extra: Sequence[tuple[str, object]] = ()) -> list:
    """gRPC channel options: message size limits, short reconnect backoff, then `extra`."""
    if max_message_bytes <= 0:
        raise InvalidArgument(f"max_message_bytes must be > 0, got {max_message_bytes}")
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.min_reconnect_backoff_ms", MIN_CONNECT_TIMEOUT_MS),
        ("grpc.max_reconnect_backoff_ms", 1000),
        *extra,
    ]


def layout_pb(layout: KvLayout) -> pb.KvLayout:
    if not isinstance(layout, KvLayout):
        raise InvalidArgument(f"layout must be a radixkv.KvLayout, got {type(layout).__name__}")
    return pb.KvLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                       head_dim=layout.head_dim, dtype=layout.dtype, page_size=layout.page_size,
                       kv_format=layout.kv_format)


def buffer_pb(spec) -> pb.DeviceBuffer:
    """A `DeviceBuffer` from a message, a `BufferSpec`, or a `(handle, offset, size[,
    page_stride, page_bytes])` tuple; a str handle (a shared-memory segment name) is
    sent as UTF-8."""
    if isinstance(spec, pb.DeviceBuffer):
        return spec
    try:
        handle, offset, size, *rest = spec
        page_stride, page_bytes = (list(rest) + [0, 0])[:2] if len(rest) <= 2 else (None, None)
    except (TypeError, ValueError):
        page_stride = None
    if page_stride is None:
        raise InvalidArgument(f"a buffer is (handle, offset, size[, page_stride, page_bytes]), got {spec!r}")
    if isinstance(handle, str):
        handle = os.fsencode(handle)
    if not isinstance(handle, (bytes, bytearray)) or min(offset, size, page_stride, page_bytes) < 0:
        raise InvalidArgument(f"bad buffer spec {spec!r}")
    return pb.DeviceBuffer(handle=bytes(handle), offset=offset, size=size, page_stride=page_stride,
                           page_bytes=page_bytes)


MAX_WAIT_FOR_RANKS_S = (2**32 - 1) / 1000  # RegisterRequest.wait_for_ranks_ms is a uint32


def register_request(namespace: str, layout: KvLayout, buffers: Iterable, num_device_pages: int, *,
                     backend: str, device: int, write_policy: str, host_pool_pages: int,
                     replace_existing: bool, engine: str, model: str, device_uuid: str = "",
                     device_tier: str = "managed", role: str = "engine", tp_rank: int = 0, tp_size: int = 1,
                     instance: str = "", wait_for_ranks: float = 0.0) -> pb.RegisterRequest:
    """`device_uuid`: the engine's GPU by UUID; for backend "cuda" it defaults to the UUID
    of cuda:`device` in this process, so the daemon finds the same GPU whatever its own
    CUDA_VISIBLE_DEVICES (see `radixkv.kvbuffers.device_uuid`). `device_tier`
    ("managed" or "engine_managed"), `role` ("engine" or "scheduler"), `tp_rank`,
    `tp_size`, `instance` and `wait_for_ranks` (seconds): see RegisterRequest in the proto."""
    if num_device_pages < 0 or host_pool_pages < 0:
        raise InvalidArgument("num_device_pages and host_pool_pages must be >= 0")
    if not (isinstance(wait_for_ranks, (int, float)) and 0 <= wait_for_ranks <= MAX_WAIT_FOR_RANKS_S):
        raise InvalidArgument(f"wait_for_ranks {wait_for_ranks!r}: seconds from 0 to {MAX_WAIT_FOR_RANKS_S:.0f}")
    if device_tier not in DEVICE_TIERS or role not in ROLES:
        raise InvalidArgument(f"device_tier {device_tier!r} / role {role!r}: use one of {list(DEVICE_TIERS)} / "
                              f"{list(ROLES)}")
    if backend == "cuda" and not device_uuid:
        from .kvbuffers import device_uuid as uuid_of  # torch and CUDA only where CUDA is used

        device_uuid = uuid_of(device)
    return pb.RegisterRequest(
        namespace=namespace, layout=layout_pb(layout), backend=backend, device=device,
        buffers=[buffer_pb(b) for b in buffers], num_device_pages=num_device_pages,
        write_policy=write_policy, host_pool_pages=host_pool_pages,
        replace_existing=replace_existing, engine=engine, model=model, device_uuid=device_uuid,
        device_tier=DEVICE_TIERS[device_tier], role=ROLES[role], tp_rank=tp_rank, tp_size=tp_size,
        instance=instance, wait_for_ranks_ms=round(wait_for_ranks * 1000))


def register_again(request: pb.RegisterRequest, buffers, replaced: bool,
                   wait_left: float | None = None) -> pb.RegisterRequest:
    """The Register a lost session sends again: `request` as first sent, with buffers that
    can be exported afresh (`fresh()`, as `CudaKvBuffers.export` gives) exported again
    (each CUDA IPC export is one reference torch counts: a handle sent twice would be
    released twice), without `replace_existing` for a `replaced` engine (another
    engine's Register took the namespace: refused again while that session lives), and
    waiting for the other ranks no longer than `wait_left` seconds (None: as first sent)."""
    fresh = getattr(buffers, "fresh", None)
    wait_ms = request.wait_for_ranks_ms if wait_left is None else min(
        request.wait_for_ranks_ms, max(0, round(wait_left * 1000)))
    if fresh is None and not (replaced and request.replace_existing) and wait_ms == request.wait_for_ranks_ms:
        return request
    again = pb.RegisterRequest()
    again.CopyFrom(request)
    again.wait_for_ranks_ms = wait_ms
    if fresh is not None:
        del again.buffers[:]
        again.buffers.extend(buffer_pb(b) for b in fresh())
    if replaced:
        again.replace_existing = False
    return again


DEVICE_TIERS = {"managed": pb.MANAGED, "engine_managed": pb.ENGINE_MANAGED}
ROLES = {"engine": pb.ENGINE, "scheduler": pb.SCHEDULER}


def event_bytes(event) -> bytes:
    """An engine event for Insert, Evict or LoadBack as IPC handle bytes: None (none), the
    handle bytes, or a `torch.cuda.Event(interprocess=True)` (see
    `CudaKvBuffers.record_event`)."""
    if event is None:
        return b""
    if isinstance(event, (bytes, bytearray)):
        return bytes(event)
    handle = getattr(event, "ipc_handle", None)
    if handle is None:
        raise InvalidArgument(f"engine_event must be IPC handle bytes or an interprocess torch.cuda.Event, "
                              f"got {type(event).__name__}")
    return bytes(handle())


def moves_pages_or_leases(method: str, request) -> bool:
    """Whether a call left unanswered may change what the engine's pages or leases are."""
    return method in ("Insert", "LoadBack", "Evict", "Release") or (method == "Match" and request.lease)


def _packed(values, what: str) -> bytes:
    """`as_packed`, with a value int32 cannot carry (or no int at all) as InvalidArgument."""
    try:
        return as_packed(values)
    except (OverflowError, TypeError, ValueError) as e:
        raise InvalidArgument(f"{what}: {e}") from None


def match_request(session: str, prompts: Iterable, lease: bool, include_storage: bool = False) -> pb.MatchRequest:
    request = pb.MatchRequest(session=session, lease=lease, include_storage=include_storage)
    add = request.prompts.add  # built in place: no Prompt message made and then copied in
    try:
        for p in prompts:
            p = Prompt.of(p)
            add(tokens=p.tokens, extra_key=p.extra_key)
    except (OverflowError, TypeError, ValueError) as e:
        raise InvalidArgument(f"prompt {len(request.prompts)}: {e}") from None
    return request


def call_timeout(timeout):
    """A call's own deadline as given: seconds > 0, None (none) or "client" (the
    client's). InvalidArgument otherwise, before anything is sent."""
    if timeout not in ("client", None) and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                            or not 0 < timeout < float("inf")):
        raise InvalidArgument(f"timeout must be a positive number of seconds, None or 'client', got {timeout!r}")
    return timeout


PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


def prefetch_request(session: str, tokens, *, extra_key: bytes, policy: str,
                     timeout: float | None) -> pb.PrefetchRequest:
    if policy not in PREFETCH_POLICIES:
        raise InvalidArgument(f"prefetch policy {policy!r}: use one of {list(PREFETCH_POLICIES)}")
    if policy == "timeout" and not (timeout and timeout > 0):
        raise InvalidArgument(f"the timeout policy needs a timeout in seconds > 0, got {timeout!r}")
    # Whole milliseconds on the wire, at least 1 (0 means none, which the daemon refuses).
    timeout_ms = max(1, round(timeout * 1000)) if policy == "timeout" else 0
    return pb.PrefetchRequest(session=session, tokens=_packed(tokens, "tokens"), extra_key=bytes(extra_key),
                              policy=policy, timeout_ms=timeout_ms)


def insert_request(session: str, tokens, device_pages, *, extra_key: bytes, chunked: bool,
                   release_lease: int, lease: bool, engine_event=None, async_: bool = False) -> pb.InsertRequest:
    """`async_` (engine-managed): the answer carries the save's transfer at once."""
    req = pb.InsertRequest(session=session, tokens=_packed(tokens, "tokens"),
                           device_pages=_packed(device_pages, "device_pages"), extra_key=bytes(extra_key),
                           chunked=chunked, release_lease=release_lease, lease=lease,
                           engine_event=event_bytes(engine_event))
    setattr(req, "async", bool(async_))  # `async` is a Python keyword
    return req


def load_back_request(session: str, node: int, device_pages, engine_event=None, lease: int = 0,
                      start_page: int = 0, wait: bool = False) -> pb.LoadBackRequest:
    """`lease`, `start_page`, `wait`: engine-managed loads (the scheduler's lease; pages
    held already; answer once copied)."""
    if lease < 0 or start_page < 0:
        raise InvalidArgument("lease and start_page must be >= 0")
    return pb.LoadBackRequest(session=session, node=node, device_pages=_packed(device_pages, "device_pages"),
                              engine_event=event_bytes(engine_event), lease=lease, start_page=start_page,
                              wait=wait)


def release_request(session: str, leases: Iterable[int]) -> pb.ReleaseRequest:
    return pb.ReleaseRequest(session=session, leases=[int(x) for x in leases if x])


def evict_request(session: str, num_pages: int, engine_event=None) -> pb.EvictRequest:
    if num_pages < 0:
        raise InvalidArgument(f"num_pages must be >= 0, got {num_pages}")
    return pb.EvictRequest(session=session, num_pages=num_pages, engine_event=event_bytes(engine_event))


def transfer_ids(ids: Iterable[int]) -> list[int]:
    """Distinct transfer ids in first-seen order, without 0 ("nothing loaded")."""
    out: dict[int, None] = {}
    for t in ids:
        t = int(t)
        if t < 0:
            raise InvalidArgument(f"transfer ids are >= 0, got {t}")
        if t:
            out[t] = None
    return list(out)


def forget_stale_events(request: pb.RegisterRequest | None) -> None:
    """A (re-)registration over CUDA: drop IPC events opened from an earlier daemon's
    handles (see `CudaKvBuffers.forget_events`). Nothing to do for shared memory."""
    if request is not None and request.backend == "cuda":
        from .kvbuffers import CudaKvBuffers  # torch and CUDA only where CUDA is used

        CudaKvBuffers.forget_events()
