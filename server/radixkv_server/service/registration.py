"""What Register needs before any state changes: validation of the request, the new
namespace's config (cache policy, host pool size), and opening the engine's device buffers."""

import asyncio
import re
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from radixkv.layout import KvLayout

from ..config import DaemonConfig
from ..core import CacheConfig
from ..core.page_keys import layout_fingerprint, namespace_salt
from ..datapath import BACKENDS, BufferSpec, DeviceOpenError, SegmentNotYours, open_device_buffers
from ..datapath.device import buffer_geometry
from ..datapath.cuda_devices import ordinal_for_uuid, visible_uuids
from . import reasons
from .errors import ServiceError, exhausted, invalid, precondition
from .namespace import Namespace
from .namespace_config import NamespaceConfig, host_layout
from .sessions import Session

MAX_PAGES = 2**31 - 1  # page ids travel as packed int32 (Insert, LoadBack, Evict answers)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


@dataclass(frozen=True)
class Registration:
    namespace: str
    layout: KvLayout
    backend: str
    device: int
    buffers: list[BufferSpec]
    num_device_pages: int
    write_policy: str = ""
    host_pool_pages: int = 0
    replace_existing: bool = False
    engine: str = ""
    model: str = ""
    device_uuid: str = ""  # cuda: the engine's GPU by UUID (then `device` is the engine's ordinal only)
    device_tier: str = "managed"  # or "engine_managed" (see engine_registration)
    role: str = "engine"          # engine-managed: "engine" (a rank's buffers) or "scheduler"
    tp_rank: int = 0
    tp_size: int = 1
    instance: str = ""
    wait_for_ranks: float = 0.0  # seconds a managed-device rank's Register waits for its group to form
    segment_uid: int | None = None  # shm: the owner the segments must have (the caller's token's uid=)
    owner: bytes = b""  # whose the session is (tenants.Grant.owner: the caller's token or its tenant=)
    token: bytes = b""  # the caller's token (its digest; tenants.Grant.token)
    quota: object = None  # token_file.Quota of the caller's tenant: what the namespaces it creates may take
    operator: bool = True  # the caller's token grants every namespace: it may replace any session
    sees: Callable[[str], bool] | None = None  # which namespaces its errors may name (None: every one)

    @property
    def engine_managed(self) -> bool:
        return self.device_tier == "engine_managed"

    @property
    def model_name(self) -> str:
        return self.model or self.namespace


@dataclass(frozen=True)
class Registered:
    session: Session
    warm: bool
    dropped_device_tokens: int


def storage_salt(reg: Registration, geometry: tuple[int, int] | None = None) -> bytes:
    """The salt of the storage keys of the namespace `reg` creates (`reg.layout` the host
    page's: it holds every rank's shard, so the rank count is part of it). `geometry`, a
    managed-device engine's `page_geometry` when it is not its layout's own split (K and
    V of each layer apart), is part of it too: another split is another byte order in
    the same host page, which the namespace's own check forgets with the namespace."""
    fingerprint = layout_fingerprint(reg.layout, reg.tp_size)
    if geometry is not None:
        fingerprint += f":b{geometry[0]}x{geometry[1]}"
    return namespace_salt(reg.model_name, fingerprint)


def check_namespace_name(name: str) -> None:
    """INVALID_ARGUMENT unless `name` could name a namespace (the message shows at most
    80 characters of it)."""
    if not _NAME.fullmatch(name):
        shown = repr(name) if len(name) <= 80 else f"{name[:80]!r}... ({len(name)} characters)"
        raise invalid(f"namespace {shown}: use 1-128 characters from A-Z a-z 0-9 . _ : / @ + -, "
                      "starting with a letter or digit")


def validate(reg: Registration) -> None:
    """INVALID_ARGUMENT for a request that can never succeed, whatever the state."""
    check_namespace_name(reg.namespace)
    if reg.backend not in BACKENDS:  # the data path's table of device backends
        raise invalid(f"backend {reg.backend!r}: use one of {list(BACKENDS)}")
    validate_ranks(reg)
    if reg.tp_size > 1 and not reg.engine_managed and not reg.instance:
        raise invalid(f"tp_size {reg.tp_size}: a tensor-parallel rank names its engine in `instance` (one id per "
                      "engine start, the same for all its ranks): ranks of two engines must never form one group")
    if reg.engine_managed:
        validate_engine_managed(reg)
        if reg.role == "scheduler":
            return
    elif reg.role != "engine":
        raise invalid("role is for engine-managed namespaces (device_tier ENGINE_MANAGED); a managed-device "
                      "namespace has one ENGINE session per tensor-parallel rank (tp_rank, tp_size)")
    if reg.num_device_pages < 1:
        raise invalid("num_device_pages must be >= 1")
    if reg.num_device_pages > MAX_PAGES:
        raise invalid(f"num_device_pages {reg.num_device_pages}: page ids are int32, at most {MAX_PAGES} pages")
    try:
        buffer_geometry(reg.layout, reg.buffers)
    except DeviceOpenError as e:
        raise invalid(f"buffers: {e}") from None


def validate_ranks(reg: Registration) -> None:
    """INVALID_ARGUMENT for a tensor-parallel rank out of range."""
    if reg.tp_size < 1 or not 0 <= reg.tp_rank < reg.tp_size:
        raise invalid(f"tp_rank {reg.tp_rank} out of range 0..{reg.tp_size - 1} (tp_size {reg.tp_size})")
    if reg.tp_size > 64:
        raise invalid(f"tp_size {reg.tp_size}: at most 64 ranks share a namespace")


def validate_engine_managed(reg: Registration) -> None:
    """INVALID_ARGUMENT for an engine-managed registration that can never succeed."""
    if reg.role == "scheduler" and (reg.buffers or reg.num_device_pages or reg.tp_rank):
        raise invalid("a SCHEDULER session sends no buffers, num_device_pages or tp_rank (it matches and "
                      "leases only; each rank registers an ENGINE session with its buffers)")


def page_geometry(reg: Registration) -> tuple[int, int] | None:
    """How the engine splits a device page over its buffers: (buffers, bytes of each
    buffer's part). A host page holds those parts one after another, so an engine that
    splits its pages otherwise (another attention backend: one buffer per layer instead
    of K and V apart) reads another byte order from the same host page. None for a
    session without buffers (a SCHEDULER). Call after `validate`."""
    if not reg.buffers:
        return None
    part, _ = buffer_geometry(reg.layout, reg.buffers)
    return len(reg.buffers), part


def check_may_replace(reg: Registration, sessions) -> None:
    """PERMISSION_DENIED when `replace_existing` would close a session another token
    registered (a tenant granted a shared namespace would end another's engine);
    an operator's token may."""
    other = next((s for s in sessions if s.owner != reg.owner), None)
    if other is not None and not reg.operator:
        raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                           f"namespace {reg.namespace}'s live session {other.id[:8]} was registered with another "
                           "token: only that token (or an operator's) may replace it", reasons.OTHER_SESSION)


def mismatch(field: str, message: str) -> ServiceError:
    """FAILED_PRECONDITION NAMESPACE_MISMATCH: the namespace holds KV that differs in `field`."""
    return precondition(message, reasons.NAMESPACE_MISMATCH, field=field)


def check_compatible(ns: Namespace, reg: Registration, policy: str) -> None:
    """FAILED_PRECONDITION when an existing namespace holds KV the engine cannot use."""
    if getattr(ns, "engine_managed", False) != reg.engine_managed:
        tier = "engine-managed" if reg.engine_managed else "managed-device"
        raise mismatch("device_tier", f"namespace {ns.name} has the other device tier: this registration asks for "
                           f"{tier}; every session of a namespace uses the tier of its first one")
    if ns.layout != reg.layout:
        raise mismatch("layout", f"namespace {ns.name} holds KV of another layout ({ns.layout}), not this "
                           f"registration's ({reg.layout}); use a new namespace name for this one")
    if ns.config.model != reg.model_name:
        raise mismatch("model", f"namespace {ns.name} holds KV of model {ns.config.model!r}, not {reg.model_name!r}: "
                           "another model's KV must not be served; use a new namespace name for this one")
    if not reg.engine_managed and ns.config.tp_size != reg.tp_size:
        raise mismatch("tp_size", f"namespace {ns.name} is shared by tp_size {ns.config.tp_size} tensor-parallel ranks, "
                           f"this session says tp_size {reg.tp_size}: every rank of an engine registers on one "
                           "namespace with the engine's tp_size")
    if policy != ns.config.cache.write_policy.value:
        raise mismatch("write_policy", f"namespace {ns.name} uses write policy {ns.config.cache.write_policy.value}, "
                           f"not {policy}")
    geometry = page_geometry(reg)
    if None not in (geometry, ns.page_geometry) and geometry != ns.page_geometry:
        raise mismatch("page_split", f"namespace {ns.name}'s host pages hold device pages split over {ns.page_geometry[0]} "
                           f"buffers of {ns.page_geometry[1]} bytes; these buffers split them {geometry[0]} x "
                           f"{geometry[1]}, another byte order: use a new namespace name for this engine")


def namespace_config(config: DaemonConfig, reg: Registration, storage_on: bool) -> NamespaceConfig:
    """The config of the namespace `reg` creates (its write policy the request's, else the
    daemon's). A tensor-parallel namespace's host pages hold every rank's shard
    (`tp_size`): its pool is sized, and its storage keys salted, by that whole page.
    INVALID_ARGUMENT for a bad policy, RESOURCE_EXHAUSTED for a host pool past the
    per-namespace limit."""
    tp_size = reg.tp_size
    host = dataclasses.replace(reg, layout=host_layout(reg.layout, tp_size))
    return NamespaceConfig(
        name=reg.namespace, layout=reg.layout,
        cache=cache_config(config, host, reg.write_policy or config.write_policy, storage_on, salted_split(reg)),
        host_pages=host_pages(config, host), pin_device=pin_device(reg), prefault_host=config.host_pool_prefault,
        copy_workers=config.copy_workers, storage_workers=config.storage_workers,
        storage_queue_pages=config.storage_queue_pages, storage_lookup_timeout=config.storage_lookup_timeout,
        copy_delay=config.fault_copy_delay,
        fail_loads=config.fault_fail_loads, model=reg.model_name, tp_size=tp_size)


def pin_device(reg: Registration) -> int | None:
    """The daemon's ordinal of the engine's GPU (cuda; None otherwise), which the host
    pool is pinned for. INVALID_ARGUMENT when the UUID names no GPU the daemon sees."""
    if reg.backend != "cuda":
        return None
    if not reg.device_uuid:
        return reg.device
    try:
        return ordinal_for_uuid(reg.device_uuid, visible_uuids())
    except DeviceOpenError as e:
        raise invalid(f"cannot open the engine's device buffers: {e}") from None


def salted_split(reg: Registration) -> tuple[int, int] | None:
    """The page split the storage keys of the namespace `reg` creates are salted with: a
    managed-device engine's buffers' `page_geometry` when it is not its layout's own (so
    keys of the usual split stay as they were). None for an engine-managed namespace: a
    SCHEDULER, which has no buffers, may create it, and its keys must not depend on which
    session came first (its engines name their byte order in `model`)."""
    geometry = None if reg.engine_managed else page_geometry(reg)
    if geometry == (reg.layout.num_buffers, reg.layout.chunk_bytes):
        return None
    return geometry


def cache_config(config: DaemonConfig, reg: Registration, policy: str, storage_on: bool,
                 split: tuple[int, int] | None = None) -> CacheConfig:
    try:
        return CacheConfig(
            page_size=reg.layout.page_size, write_policy=policy,
            write_through_threshold=config.write_through_threshold,
            eviction_policy=config.eviction_policy,
            storage=config.storage_policy if storage_on else "off",
            storage_salt=storage_salt(reg, split))
    except ValueError as e:
        raise invalid(str(e)) from None


def host_pages(config: DaemonConfig, reg: Registration) -> int:
    """Host pool pages for a new namespace; RESOURCE_EXHAUSTED past the per-namespace limit,
    or when the default pool holds no page of the layout (a namespace that can cache nothing)."""
    page_bytes = reg.layout.page_bytes
    limit = min(config.host_pool_limit // page_bytes, MAX_PAGES)
    if reg.host_pool_pages:
        if reg.host_pool_pages > limit:
            raise exhausted(
                f"host pool of {reg.host_pool_pages} pages ({reg.host_pool_pages * page_bytes} bytes) "
                f"exceeds the per-namespace limit of {limit} pages ({config.host_pool_limit} bytes"
                f"{'; page ids are int32' if limit == MAX_PAGES else ''})")
        return reg.host_pool_pages
    pages = config.host_pool_size // page_bytes
    if pages < 1:
        raise exhausted(f"a host page of this layout is {page_bytes} bytes, more than the whole host pool "
                        f"({config.host_pool_size} bytes): raise --host-pool-size, or ask for host_pool_pages")
    if pages > MAX_PAGES:
        raise exhausted(f"the default host pool ({config.host_pool_size} bytes) holds {pages} pages of "
                        f"{page_bytes} bytes; page ids are int32: ask for host_pool_pages <= {MAX_PAGES}")
    return pages


async def open_device(reg: Registration):
    """The engine's device buffers, opened off the loop; INVALID_ARGUMENT when they can't be."""
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(
            None, open_device_buffers, reg.backend, reg.layout, reg.num_device_pages,
            reg.buffers, reg.device, reg.device_uuid, reg.segment_uid)
    except SegmentNotYours as e:
        raise ServiceError(grpc.StatusCode.PERMISSION_DENIED, f"cannot open the engine's device buffers: {e}") from None
    except DeviceOpenError as e:
        raise invalid(f"cannot open the engine's device buffers: {e}") from None
