"""The daemon's configuration: one frozen dataclass. CLI flags and RADIXKV_* environment
variables are derived from its fields (flag `--host-pool-size` <-> field
`host_pool_size` <-> variable `RADIXKV_HOST_POOL_SIZE`); precedence is flag, then
environment, then the default written here."""

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlencode, urlsplit

from radixkv.channel import DEFAULT_TARGET

from . import __version__
from .core.evictable import STRATEGIES
from .core.cache_config import StoragePolicy, WritePolicy
from .events.config import EventsConfig
from .units import parse_size

DEFAULT_SOCKET = DEFAULT_TARGET  # the clients' default address: daemon and clients on defaults meet
MIN_MESSAGE_SIZE = 1 << 20  # bytes: below it even a health check or a Register may not fit


def flag(name: str) -> str:
    """A setting as the command line spells it (`max_sessions` -> `--max-sessions`)."""
    return "--" + name.replace("_", "-")


def _values(enum_type, *, skip=()) -> tuple[str, ...]:
    """The values of a core enum, as CLI choices (one list, owned by the core)."""
    return tuple(m.value for m in enum_type if m not in skip)


def _opt(default, help: str, *, size: bool = False, repeat: bool = False, choices=None):
    meta = {"help": help, "size": size, "repeat": repeat, "choices": choices}
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DaemonConfig:
    listen: tuple[str, ...] = _opt(
        (DEFAULT_SOCKET,), "gRPC address: unix:///path.sock or host:port (repeatable; "
        "TCP binds where told, use 127.0.0.1 for loopback only)", repeat=True)
    metrics_port: int = _opt(9464, "Prometheus /metrics HTTP port (0: off)")
    metrics_host: str = _opt("127.0.0.1", "address the metrics port binds (:: for every IPv6 and IPv4 address)")
    host_pool_size: int = _opt(4 * 1024**3, "host (L2) pool per namespace, bytes (e.g. 4GiB)", size=True)
    max_host_pool_size: int = _opt(0, "largest host pool a Register may ask for (0: host_pool_size)", size=True)
    host_pool_prefault: bool = _opt(False, "fault a namespace's whole host pool in at its Register (about a "
                                    "tenth to a fifth of a second per 256 MiB), so no copy pays the kernel's "
                                    "first touch of a host page; commits the pool's memory at once (pinned pools "
                                    "always are)")
    page_size: int = _opt(16, "tokens per page when a Register's layout leaves it 0")
    write_policy: str = _opt("write_through", "default write policy",
                             choices=_values(WritePolicy))
    write_through_threshold: int = _opt(2, "hits before write_through_selective backs a node up")
    eviction_policy: str = _opt("lru", "eviction order", choices=tuple(STRATEGIES))
    copy_workers: int = _opt(2, "threads copying pages per namespace")
    storage: str = _opt("", "L3 storage: file:///dir (or a path), redis://host:port/db, unix:///redis.sock, "
                        "redis+cluster://host:port,host:port,... or mooncake://master:port?... "
                        "(docs/operations.md lists each URL's options; empty: off)")
    storage_policy: str = _opt("write_back", "when pages go to storage: on host eviction (write_back) or "
                               "as soon as they reach host (write_through)",
                               choices=_values(StoragePolicy, skip=(StoragePolicy.OFF,)))
    storage_workers: int = _opt(2, "threads doing storage I/O per namespace, for reads and for writes each")
    storage_queue_pages: int = _opt(4096, "pages queued for storage writes before new ones are refused")
    storage_lookup_timeout: float = _opt(2.0, "seconds an engine call (Match with storage, Prefetch) waits for "
                                         "storage to say what it holds, and an Evict for the backups or stores that "
                                         "free room (once per copy); past it the call answers without storage and lookups skip storage "
                                         "until that one answers (0: no limit)")
    storage_check_interval: float = _opt(10.0, "seconds between checks of a storage tier that did not answer "
                                         "at start, until one succeeds (radixkv_storage_up reads 0 meanwhile)")
    malloc_trim_threshold: int = _opt(256 * 1024**2, "freed heap glibc's malloc keeps for reuse instead of "
                                      "returning it to the kernel, per malloc arena (each I/O thread may have its "
                                      "own), so the reply buffers of each storage fetch do not fault in fresh "
                                      "memory (0: glibc's default)", size=True)
    max_sessions: int = _opt(64, "most sessions at once")
    max_leases_per_session: int = _opt(100_000, "most leases one session may hold at once; a Match or Insert "
                                       "that would take more is RESOURCE_EXHAUSTED (an engine holding this many "
                                       "forgets to release them, and they pin their pages)")
    max_namespaces: int = _opt(64, "most namespaces at once")
    reclaim_detached_after: float = _opt(60.0, "seconds a namespace must have had no engine attached before a new "
                                         "namespace's Register, refused for --max-namespaces or the host memory "
                                         "budget, may drop it to make room (the one detached longest first; its "
                                         "host KV is lost, storage keeps what it holds); 0: never")
    max_host_memory: int = _opt(0, "most bytes all namespaces' host pools may take together; a Register "
                                "past it is refused (0: a cgroup memory limit less 1 GiB, or else 80%% of "
                                "the machine's memory)", size=True)
    max_prompts_per_match: int = _opt(4096, "most prompts in one Match")
    max_extra_key_bytes: int = _opt(4096, "longest extra_key (a LoRA adapter's name and path, a salt) a "
                                    "Match, Insert or Prefetch may carry; each cached node keeps its own", size=True)
    max_message_size: int = _opt(64 * 1024**2, "largest gRPC message, bytes", size=True)
    max_concurrent_rpcs: int = _opt(1024, "RadixKV calls in progress (streams, calls waiting in the daemon) before "
                                    "new ones get RESOURCE_EXHAUSTED; health checks are not counted, and gRPC's own "
                                    "bound, 64 calls above, caps bursts of quick unary calls")
    shutdown_grace: float = _opt(10.0, "seconds in-flight RPCs get on shutdown")
    shutdown_store_timeout: float = _opt(20.0, "seconds a graceful shutdown may spend storing host pages that "
                                         "storage does not hold yet (with --storage; 0: none)")
    lease_timeout: float = _opt(0.0, "seconds a lease may be held before the daemon releases it "
                                "(a stuck engine); 0: never")
    ack_timeout: float = _opt(0.0, "seconds a load-back may stay unacknowledged before the daemon "
                              "finishes it as a session close would; 0: never")
    idle_session_timeout: float = _opt(300.0, "seconds a session that never opened an Acks or Session stream "
                                       "may go without a call before the daemon closes it (its engine died "
                                       "before opening one; a by-hand session left behind); 0: never")
    invariant_check_interval: float = _opt(0.0, "seconds between invariant checks of every namespace, each "
                                           "run once no engine call came for a second; violations are "
                                           "logged and counted (radixkv_invariant_violations_total); 0: off")
    max_acks_in_flight: int = _opt(4096, "acks one stream may have unanswered before the daemon stops "
                                   "reading it (gRPC flow control then holds the engine)")
    tls_cert: str = _opt("", "PEM certificate chain for TCP listeners (with --tls-key: TLS on TCP; "
                         "unix sockets stay plain, guarded by file permissions)")
    tls_key: str = _opt("", "PEM private key of --tls-cert")
    tls_client_ca: str = _opt("", "PEM CA bundle: require TCP clients to present a certificate it "
                              "signed (mutual TLS)")
    auth_token: str = _opt("", "shared token: every RPC but health checks must carry "
                           "'authorization: Bearer <token>' (prefer --auth-token-file)")
    auth_token_file: str = _opt("", "file of tokens, one a line, each followed by the namespace globs it "
                                "grants (none: all); reread on SIGHUP (docs/reliability.md)")
    kv_events_endpoint: str = _opt("", "ZMQ PUB address for KV events in vLLM's format, e.g. tcp://*:5557 "
                                   "(empty: off; docs/events.md)")
    kv_events_replay_endpoint: str = _opt("", "ZMQ ROUTER address replaying KV event batches by seq, "
                                          "e.g. tcp://*:5558 (needs kv_events_endpoint)")
    kv_events_topic: str = _opt("kv@{namespace}", "KV events topic; {namespace} is substituted")
    kv_events_watch: bool = _opt(False, "serve the WatchEvents gRPC stream (runs the event hub even "
                                 "without ZMQ)")
    kv_events_queue_size: int = _opt(10000, "KV event batches queued for the publisher thread before "
                                     "drops (a dropped batch is followed by a resync)")
    kv_events_replay_size: int = _opt(10000, "KV event batches kept for replay (ZMQ and WatchEvents)")
    kv_events_replay_bytes: int = _opt(256 * 1024**2, "most bytes the KV event batches kept for replay may hold "
                                       "(the oldest go first)", size=True)
    kv_events_hwm: int = _opt(100000, "ZMQ send high-water mark per KV event subscriber")
    kv_events_subscriber_buffer: int = _opt(1000, "KV event batches one WatchEvents stream may fall "
                                            "behind before it is ended with ABORTED")
    kv_events_hash_seed: str = _opt("vllm-none-hash", "block-hash seed of KV events (vLLM's NONE_HASH "
                                    "seed; a fleet's PYTHONHASHSEED)")
    kv_events_data_parallel_rank: int = _opt(0, "data_parallel_rank written into every KV event batch: the "
                                             "vLLM data-parallel rank of the one engine this daemon serves (routers "
                                             "such as Dynamo's key workers by it)")
    kv_events_presence: bool = _opt(False, "KV events say only whether a block is on this daemon (device or "
                                    "host): stored when it first is, removed when on neither, with no medium "
                                    "and no storage blocks, for routers that ignore medium (Dynamo's)")
    fault_copy_delay: float = _opt(0.0, "testing only: seconds each page copy waits before it starts")
    fault_fail_loads: float = _opt(0.0, "testing only: fraction (0-1) of host->device load copies that "
                                   "fail (1: every one), as a broken GPU copy would")
    log_level: str = _opt("info", "log level", choices=("debug", "info", "warning", "error"))
    log_format: str = _opt("text", "log lines as key=value text or JSON", choices=("text", "json"))

    def __post_init__(self):
        """ValueError naming the setting as the command line spells it (each is also
        RADIXKV_<NAME> in the environment)."""
        if not self.listen:
            raise ValueError("--listen: give at least one address")
        if len(set(self.listen)) != len(self.listen):
            raise ValueError(f"--listen: an address is given twice ({', '.join(self.listen)})")
        for name in ("page_size", "write_through_threshold", "copy_workers", "storage_workers",
                     "storage_queue_pages", "max_sessions", "max_leases_per_session", "max_namespaces",
                     "max_prompts_per_match", "max_extra_key_bytes", "max_concurrent_rpcs", "max_acks_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.max_prompts_per_match > 2**32 - 1:  # Register says it as a uint32
            raise ValueError(f"--max-prompts-per-match must be at most {2**32 - 1}, got {self.max_prompts_per_match}")
        for name in ("lease_timeout", "ack_timeout", "idle_session_timeout"):  # Register says them in uint64 ms
            if getattr(self, name) > 1e15:
                raise ValueError(f"{flag(name)} must be at most 1e15 seconds (0: off), got {getattr(self, name)}")
        for name in ("shutdown_grace", "shutdown_store_timeout", "storage_lookup_timeout", "lease_timeout",
                     "ack_timeout", "idle_session_timeout", "fault_copy_delay", "invariant_check_interval",
                     "reclaim_detached_after"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{flag(name)} must be a number of seconds >= 0, got {getattr(self, name)}")
        if not (math.isfinite(self.storage_check_interval) and 0.1 <= self.storage_check_interval <= 3600):
            raise ValueError(f"--storage-check-interval must be a number of seconds in 0.1-3600, "
                             f"got {self.storage_check_interval}")
        if not 0 <= self.fault_fail_loads <= 1:
            raise ValueError(f"--fault-fail-loads must be in [0, 1], got {self.fault_fail_loads}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.auth_token and self.auth_token_file:
            raise ValueError("give --auth-token or --auth-token-file, not both")
        if not 0 <= self.malloc_trim_threshold < 2 * 1024**3:
            raise ValueError(f"--malloc-trim-threshold must be 0..2GiB, got {self.malloc_trim_threshold}")
        if self.host_pool_size < 1 or self.max_host_pool_size < 0:
            raise ValueError(f"--host-pool-size must be > 0 (a namespace's pool unless its Register asks for "
                             f"another) and --max-host-pool-size >= 0, got {self.host_pool_size} and "
                             f"{self.max_host_pool_size}")
        if self.max_message_size < MIN_MESSAGE_SIZE:
            raise ValueError(f"--max-message-size must be at least {MIN_MESSAGE_SIZE >> 20}MiB (a Register or a "
                             f"batched Match would not fit), got {self.max_message_size}")
        EventsConfig.from_daemon(self)  # the kv_events_* settings, checked even when events are off
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{flag(f.name)} must be one of {list(choices)}, got {getattr(self, f.name)!r}")

    @property
    def host_pool_limit(self) -> int:
        return self.max_host_pool_size or self.host_pool_size

    def describe(self) -> dict:
        """Every field, for the start-up log; secrets (the token, a password in the
        storage URL) are never shown."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if out["auth_token"]:
            out["auth_token"] = "<set>"
        out["storage"] = without_passwords(out["storage"])
        return out


def without_passwords(url: str) -> str:
    """`url` with the password of its user part and of any `*password*` option replaced
    by `<set>`, also in an option that is itself a URL (Mooncake's `metadata=` etcd or
    http address); the rest (user, hosts, options) kept for the log."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    secret_options = any("password" in k.lower() or without_passwords(v) != v for k, v in pairs)
    if parts.password is None and not secret_options:
        return url
    netloc = parts.netloc
    if parts.password is not None:
        user, _, hosts = netloc.rpartition("@")
        netloc = f"{user.partition(':')[0]}:<set>@{hosts}"
    query = parts.query
    if secret_options:
        query = urlencode([(k, "<set>" if "password" in k.lower() else without_passwords(v)) for k, v in pairs],
                          safe="<>:/@")
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def _convert(f: dataclasses.Field, text: str):
    if f.metadata.get("size"):
        return parse_size(text)
    kind = type(f.default) if f.default is not dataclasses.MISSING else str
    if kind is bool:
        word = text.strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(f"expected true or false (or {'/'.join(_TRUE[1:])}, {'/'.join(_FALSE[1:])}), "
                             f"got {text!r}")
        return word in _TRUE
    return kind(text)


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def unknown_variables(environ: dict[str, str] | None = None) -> list[str]:
    """The RADIXKV_* variables of `environ` that name no setting (a typo, or one meant
    for another program): ignored, which the daemon says at start."""
    environ = os.environ if environ is None else environ
    known = {"RADIXKV_" + f.name.upper() for f in dataclasses.fields(DaemonConfig)}
    return sorted(name for name in environ if name.startswith("RADIXKV_") and name not in known)


def _shown(f: dataclasses.Field, default) -> str:
    """A default as a user would write it: sizes in binary units, lists comma-separated."""
    if isinstance(default, tuple):
        return ", ".join(default)
    if f.metadata.get("size") and default:
        for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
            if default % scale == 0:
                return f"{default // scale}{unit}"
    if default == "":
        return "''"
    return str(default)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixkv-server",
        description="radixkv: hierarchical KV-cache daemon for LLM inference engines. "
        "Every flag can also be set as RADIXKV_<FLAG_NAME> in the environment.",
    )
    for f in dataclasses.fields(DaemonConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        # default=None: an unset flag falls through to the environment, then the field's
        # default, which the help states once (written here, not by argparse).
        kwargs = {"help": f"{f.metadata['help']} (default: {_shown(f, default)})", "dest": f.name,
                  "default": None}
        if f.metadata.get("repeat"):
            kwargs["action"] = "append"
        else:
            kwargs["type"] = str
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]  # argparse shows them as {a,b,c}
        elif not f.metadata.get("repeat"):
            kwargs["metavar"] = f.name.upper()
        parser.add_argument(flag, **kwargs)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def load_config(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> DaemonConfig:
    """Resolve the configuration from flags, then RADIXKV_* variables, then defaults.
    Raises SystemExit (argparse) for unknown flags and ValueError for bad values."""
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    values = {}
    for f in dataclasses.fields(DaemonConfig):
        given = getattr(args, f.name)
        env = environ.get("RADIXKV_" + f.name.upper())
        if f.metadata.get("repeat"):
            if given:
                values[f.name] = tuple(given)
            elif env:
                values[f.name] = tuple(x.strip() for x in env.split(",") if x.strip())
            continue
        text = given if given is not None else env
        if text is None:
            continue
        try:
            values[f.name] = _convert(f, text)
        except ValueError as e:
            where = flag(f.name) if given is not None else "RADIXKV_" + f.name.upper()
            raise ValueError(f"{where}: {e}") from None
    return DaemonConfig(**values)
