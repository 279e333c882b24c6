"""Conversions between protobuf messages and the service's own types (`calls`), with the
checks only the wire needs (packed int32 lengths through `core.pages.require_packed`,
limits, enum names): each failure is refused (INVALID_ARGUMENT, RESOURCE_EXHAUSTED for
a limit) naming the bad field. Layouts go out through the client's one converter,
`radixkv.messages.layout_pb` (the daemon may import the client, never the reverse).
"""

from radixkv.layout import KvLayout
from radixkv.v1 import radixkv_pb2 as pb

from ..core import FinishResult
from ..core.pages import require_packed
from ..datapath import BufferSpec
from .calls import (
    EvictAnswer, InsertAnswer, InsertRequest, LoadBackAnswer, MatchAnswer, PrefetchPolicy, PrefetchRequest,
    PrefetchState, PrefetchStep, Prompt,
)
from . import reasons
from .errors import exhausted, invalid
from .registration import Registration

_PREFETCH_STATES = {
    PrefetchState.NOTHING: pb.PrefetchProgress.NOTHING, PrefetchState.STARTED: pb.PrefetchProgress.STARTED,
    PrefetchState.DONE: pb.PrefetchProgress.DONE, PrefetchState.WAITING_ENDED: pb.PrefetchProgress.WAITING_ENDED,
}


def layout_from_pb(msg: pb.KvLayout, default_page_size: int) -> KvLayout:
    """A KvLayout from the wire; INVALID_ARGUMENT naming the bad field."""
    try:
        return KvLayout(
            num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim,
            dtype=msg.dtype, page_size=msg.page_size or default_page_size,
            kv_format=msg.kv_format or "mha")
    except (ValueError, TypeError) as e:
        raise invalid(f"layout: {e}") from None


def registration(request: pb.RegisterRequest, default_page_size: int) -> Registration:
    if not request.HasField("layout"):
        raise invalid("layout is required")
    return Registration(
        namespace=request.namespace, layout=layout_from_pb(request.layout, default_page_size),
        backend=request.backend or "shm", device=request.device,
        buffers=[BufferSpec(b.handle, b.offset, b.size, b.page_stride, b.page_bytes) for b in request.buffers],
        num_device_pages=request.num_device_pages, write_policy=request.write_policy,
        host_pool_pages=request.host_pool_pages, replace_existing=request.replace_existing,
        engine=request.engine, model=request.model, device_uuid=request.device_uuid,
        wait_for_ranks=request.wait_for_ranks_ms / 1000, **engine_managed_fields(request))


def engine_managed_fields(request: pb.RegisterRequest) -> dict:
    """Register's engine-managed fields as Registration keywords (INVALID_ARGUMENT for an
    unknown enum number)."""
    tiers = {pb.MANAGED: "managed", pb.ENGINE_MANAGED: "engine_managed"}
    roles = {pb.ENGINE: "engine", pb.SCHEDULER: "scheduler"}
    if request.device_tier not in tiers or request.role not in roles:
        raise invalid(f"device_tier {request.device_tier} / role {request.role}: unknown value "
                      "(DeviceTier MANAGED=0, ENGINE_MANAGED=1; SessionRole ENGINE=0, SCHEDULER=1)")
    return dict(device_tier=tiers[request.device_tier], role=roles[request.role], tp_rank=request.tp_rank,
                tp_size=request.tp_size or 1, instance=request.instance)


IPC_EVENT_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)


def engine_event(request) -> bytes:
    """The engine's interprocess event of an Insert, Evict or LoadBack (b"": none);
    INVALID_ARGUMENT when it is not a CUDA IPC event handle (64 bytes)."""
    ev = request.engine_event
    if ev and len(ev) != IPC_EVENT_HANDLE_BYTES:
        raise invalid(f"engine_event is {len(ev)} bytes; a CUDA IPC event handle is {IPC_EVENT_HANDLE_BYTES} "
                      "(torch.cuda.Event(interprocess=True).ipc_handle())")
    return ev


def extra_key(key: bytes, limit: int, where: str = "") -> bytes:
    """`key`, or INVALID_ARGUMENT when it is longer than `limit` bytes (every node cached
    under it keeps a copy: a key of megabytes made the tree outgrow its pools)."""
    if len(key) > limit:
        raise invalid(f"{where}extra_key is {len(key)} bytes; the limit is {limit} (--max-extra-key-bytes)")
    return key


def prompts(request: pb.MatchRequest, limit: int, key_limit: int) -> list[Prompt]:
    """RESOURCE_EXHAUSTED past `limit` prompts; INVALID_ARGUMENT naming a prompt whose
    tokens are not packed int32 or whose extra_key is past `key_limit` bytes."""
    given = request.prompts
    if len(given) > limit:
        raise exhausted(f"{len(given)} prompts in one Match; the limit is {limit} (--max-prompts-per-match)",
                        reasons.LIMIT_REACHED, limit="--max-prompts-per-match")
    out = []
    for p in given:
        tokens = p.tokens  # each read of a bytes field is a copy: read it once
        require_packed(tokens, f"prompt {len(out)}: token")
        out.append(Prompt(tokens, extra_key(p.extra_key, key_limit, f"prompt {len(out)}: ")))
    return out


# The *_response functions fill `out` (a fresh message, or the field of the Session
# stream's SessionResponse: see engine_ops) and return it.

def match_response(answers: list[MatchAnswer], out: pb.MatchResponse) -> pb.MatchResponse:
    add = out.results.add
    for a in answers:
        r = a.result
        add(device_pages=r.device_pages, device_tokens=r.device_tokens, host_tokens=r.host_tokens,
            device_node=r.device_node, host_node=r.host_node, depends_on=r.depends_on, lease=a.lease,
            storage_tokens=a.storage_tokens, complete_tokens=a.complete_tokens)
    return out


def insert_request(request: pb.InsertRequest, key_limit: int) -> InsertRequest:
    """INVALID_ARGUMENT for an extra_key past `key_limit` bytes."""
    return InsertRequest(request.tokens, request.device_pages, extra_key(request.extra_key, key_limit),
                         request.chunked,
                         request.release_lease, request.lease, getattr(request, "async"))


def insert_response(answer: InsertAnswer, out: pb.InsertResponse) -> pb.InsertResponse:
    r = answer.result
    out.cached_tokens, out.redundant_pages, out.node = r.cached_tokens, r.redundant_pages, r.node
    out.lease, out.transfer = answer.lease, answer.transfer
    return out


def load_back_response(answer: LoadBackAnswer, out: pb.LoadBackResponse) -> pb.LoadBackResponse:
    r = answer.result
    out.transfer, out.device_pages, out.device_tokens = r.transfer, r.device_pages, r.device_tokens
    out.loaded_tokens, out.unused_pages = r.loaded_tokens, r.unused_pages
    out.depends_on.extend(r.depends_on)
    out.layer_events.extend(answer.layer_events)
    return out


def evict_response(answer: EvictAnswer, out: pb.EvictResponse) -> pb.EvictResponse:
    out.freed_pages, out.written_back_pages = answer.freed_pages, answer.written_back_pages
    return out


def prefetch_request(request: pb.PrefetchRequest, key_limit: int) -> PrefetchRequest:
    """INVALID_ARGUMENT for tokens that are not packed int32, an extra_key past
    `key_limit` bytes, an unknown policy, or policy "timeout" without a timeout."""
    require_packed(request.tokens, "token")
    try:
        policy = PrefetchPolicy(request.policy or PrefetchPolicy.BEST_EFFORT.value)
    except ValueError:
        raise invalid(f"prefetch policy {request.policy!r}: use one of {[p.value for p in PrefetchPolicy]}") from None
    if policy is PrefetchPolicy.TIMEOUT and not request.timeout_ms:
        raise invalid("prefetch policy 'timeout' needs timeout_ms > 0 (how long to wait for the fetch)")
    timeout = request.timeout_ms / 1000 if request.timeout_ms else None
    return PrefetchRequest(request.tokens, extra_key(request.extra_key, key_limit), policy, timeout)


def prefetch_progress(step: PrefetchStep) -> pb.PrefetchProgress:
    return pb.PrefetchProgress(
        state=_PREFETCH_STATES[step.state], transfer=step.transfer, storage_tokens=step.storage_tokens,
        fetched_tokens=step.fetched_tokens, host_tokens_added=step.host_tokens_added)


def ack_response(transfer: int, result: FinishResult) -> pb.AckResponse:
    """A finished load-back; a failed copy is a load_failed answer, not an error status."""
    return pb.AckResponse(transfer=transfer, code=0, message=result.error or "",
                          load_failed=result.error is not None, failed_pages=result.failed_pages)

