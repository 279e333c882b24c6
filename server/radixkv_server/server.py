"""serve(): the gRPC server around one Daemon, from start to a clean exit.

SIGHUP reloads the token file and the TLS certificates (logged; the daemon serves on).

Shutdown order (SIGTERM/SIGINT): health NOT_SERVING -> refuse new sessions -> finish
copies in flight -> end WatchEvents streams, server.stop(grace) -> remove socket files
-> close sessions (finish load-backs, release leases), store what only the host tier
holds -> close device handles and unpin host pools -> publish the last KV events
(namespaces cleared) and stop the event publisher -> close storage -> stop metrics. A
start that fails part-way closes what it opened in the same order.
"""

import asyncio
import contextlib
import errno
import gc
import logging
import os
import signal
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from radixkv.channel import fallback_target
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc as pb_grpc

from .config import DEFAULT_SOCKET, DaemonConfig, without_passwords
from .events import EventHub, EventsConfig
from .logs import log_event
from .metrics import Metrics
from .service.auth import AuthError, ReloadableTls, TokenAuth
from .service import host_budget
from .service.daemon import Daemon
from .service.health import HealthServicer
from .service.reflection import CommentedReflection
from .service.rpc_limit import RESERVE, RpcLimit, is_other_than_a_check
from .storage import StorageUnavailable, open_storage
from .storage_check import check_storage
from .service.servicer import RadixKVServicer
from .service.tenants import TokenFileError, Tokens
from .service.wire import guarded

log = logging.getLogger("radixkv.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RadixKV"].full_name


class StartupError(Exception):
    """The daemon cannot start as configured (the message says why and what to do)."""


class BadSetting(StartupError):
    """A flag's or variable's value that no daemon could start with, found past the
    config's own checks (exit code 2, as for those)."""


def _unix_path(address: str) -> str | None:
    if address.startswith("unix://"):
        return address[len("unix://"):]
    if address.startswith("unix:"):
        return address[len("unix:"):]
    return None


def _prepare_socket(path: str) -> None:
    """Create the socket's directory (0750) and clear a stale socket file. StartupError
    for a directory that cannot be made, another process listening there, or a file
    there that is not a socket (it is the operator's, never removed)."""
    try:
        Path(path).parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    except OSError as e:
        raise StartupError(f"cannot create the socket's directory {Path(path).parent}: {e.strerror or e}") from None
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StartupError(f"{path} exists and is not a socket; remove it or pick another --listen")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: left over from a killed daemon
        return
    finally:
        probe.close()
    raise StartupError(f"another process already listens on {path}; stop it or pick another --listen")


def _resolve_listen(config: DaemonConfig) -> list[str]:
    """The configured addresses; the default socket falls back to a per-user runtime
    directory (`radixkv.channel.fallback_target`, where clients on defaults look too)
    when /run/radixkv cannot be created or written (not root). StartupError when the
    fallback's directory belongs to another user."""
    addresses = list(config.listen)
    if addresses != [DEFAULT_SOCKET]:
        return addresses
    parent = Path(_unix_path(DEFAULT_SOCKET)).parent
    try:
        parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        if os.access(parent, os.W_OK | os.X_OK):
            return addresses
    except PermissionError:
        pass
    fallback = fallback_target()
    base = Path(_unix_path(fallback)).parent.parent
    try:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        owner = base.stat().st_uid
    except OSError as e:
        raise StartupError(f"no permission to use {parent}, and cannot create {base}: {e.strerror or e}") from None
    if owner != os.getuid():
        raise StartupError(f"no permission to use {parent}, and {base} belongs to another user (uid {owner}); "
                           "pass --listen")
    log_event(log, "listen.fallback", logging.WARNING, wanted=DEFAULT_SOCKET, using=fallback,
              reason=f"no permission to use {parent}")
    return [fallback]


def _bind(server: grpc.aio.Server, address: str,
          tls: grpc.ServerCredentials | None = None) -> tuple[str | None, str]:
    """Listen on `address`; TCP uses `tls` when given (unix sockets are guarded by their
    file mode instead). Returns (the socket path of a unix address, else None; the
    address as bound: a TCP port 0 replaced by the port the system chose)."""
    path = _unix_path(address)
    if path is not None:
        _prepare_socket(path)
    else:
        _check_port(address)
        _probe_tcp(address)
    try:
        if path is None and tls is not None:
            port = server.add_secure_port(address, tls)
        else:
            if path is None:
                log_event(log, "listen.plaintext_tcp", logging.WARNING, address=address,
                          hint="anyone who can reach it can call; set --tls-cert/--tls-key (and --auth-token-file)")
            port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise StartupError(f"cannot listen on {address}: {e}") from None
    if path is None and port == 0:
        raise StartupError(f"cannot listen on {address} (address in use or not local?)")
    return path, address if path is not None else f"{address.rpartition(':')[0]}:{port}"


def _remove_sockets(paths) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _probe_tcp(address: str) -> None:
    """StartupError naming the cause when `address` cannot be bound (in use, not this
    machine's, no such host), found by binding each of its addresses here and letting
    them go: gRPC's own error says only "Failed to bind", the cause going to a line of
    its C core. Addresses in gRPC's URI forms (vsock:, ipv4:, ...) and families this
    kernel lacks are left to gRPC."""
    if address.startswith(("vsock:", "ipv4:", "ipv6:", "dns:")):
        return
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(None if host in ("", "*") else host, int(port), type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StartupError(f"cannot listen on {address}: host {host!r}: {e.strerror}") from None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
                probe.bind(sockaddr)
        except OSError as e:
            if e.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL) and len(infos) > 1:
                continue  # a family or address this machine lacks; gRPC binds the others
            if e.errno == errno.EAFNOSUPPORT:
                return
            raise StartupError(f"cannot listen on {address}: {e.strerror or e}") from None


def _check_host_pool(config: DaemonConfig) -> tuple[int, str]:
    """The daemon's host memory budget and where it comes from, worked out once for the
    daemon's life (the Daemon admits against it). Says it at start; warns when a
    namespace's default host pool is past it: every Register that does not ask for fewer
    pages (host_pool_pages) will be refused. (Not refused: engines that size their pools
    still work.)"""
    limit, source = host_budget.host_memory_limit(config.max_host_memory)
    log_event(log, "host_memory.budget", budget=limit, source=source)
    if config.host_pool_size > limit:
        log_event(log, "host_pool.over_budget", logging.WARNING, host_pool_size=config.host_pool_size,
                  budget=limit, source=source,
                  note="Registers that do not ask for fewer host_pool_pages will be refused; lower --host-pool-size")
    return limit, source


def _check_port(address: str) -> None:
    """StartupError for a TCP address without a port in 0-65535 (gRPC would bind a port
    modulo 65536, not the one asked for)."""
    if address.startswith(("/", ".", "~")) or ":" not in address:
        raise BadSetting(f"cannot listen on {address}: a Unix socket is unix://PATH (unix:///run/x.sock), "
                         "a TCP address HOST:PORT")
    port = address.rpartition(":")[2]
    if not (port.isdigit() and int(port) < 65536):
        raise BadSetting(f"cannot listen on {address}: the port must be a number in 0-65535")


def _open_events(config: DaemonConfig, loop: asyncio.AbstractEventLoop) -> EventHub | None:
    """The KV-event hub, when ZMQ events or WatchEvents are on (None otherwise: the core's
    residency seam then costs nothing)."""
    if not (config.kv_events_endpoint or config.kv_events_watch):
        return None
    events_config = EventsConfig.from_daemon(config)  # checked when the DaemonConfig was made
    try:
        hub = EventHub(events_config, call_later=loop.call_later)
    except ValueError as e:
        raise StartupError(f"kv events: {e}") from None
    log_event(log, "kv_events.started", endpoint=config.kv_events_endpoint or "-",
              replay=config.kv_events_replay_endpoint or "-", watch=config.kv_events_watch)
    return hub


def _reload(reloadable: list) -> None:
    """SIGHUP: read the token file and the TLS certificates again (each logs how it went;
    /metrics' radixkv_config_last_reload_successful says whether it took effect).
    `reloadable`: (what, its reload() -> bool, Metrics)."""
    log_event(log, "daemon.reload", what=",".join(what for what, _, _ in reloadable) or "nothing")
    for what, reload, metrics in reloadable:
        metrics.reloaded(what, reload())


def _freeze_startup_objects() -> None:
    """What startup built (the imported libraries: torch, gRPC, numpy) lives as long as
    the daemon: move it out of the garbage collector's reach. A full collection, which
    Python runs once the objects that survived collections grow by a quarter (a tree
    growing, a snapshot's records), otherwise scans it all: about 0.2 s with the loop
    stopped (engines' calls waited that long), against a few ms for what serving makes."""
    gc.collect()
    gc.freeze()


async def serve(config: DaemonConfig, stop: asyncio.Event | None = None,
                stopped_early: Callable[[], bool] = lambda: False) -> int:
    """Run until `stop` is set or SIGTERM/SIGINT arrives (or arrived before, as
    `stopped_early` says: then the daemon stops as soon as it started); returns the exit
    code. Whatever was opened is closed, in the shutdown order (the module's docstring),
    also when the start fails part-way (a port in use after storage joined its cluster)."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if stopped_early():
        stop.set()
    reloadable: list = []  # what SIGHUP reads again, once opened below
    loop.add_signal_handler(signal.SIGHUP, _reload, reloadable)

    host_memory = _check_host_pool(config)
    async with contextlib.AsyncExitStack() as stack:
        running = _Teardown(stack)
        daemon, health_servicer = await _start(config, loop, running, reloadable, host_memory)
        await stop.wait()
        log_event(log, "daemon.stopping", sessions=len(daemon.sessions))
        await health_servicer.enter_graceful_shutdown()
        daemon.stop_accepting()
        await daemon.drain()
        log_event(log, "daemon.drained")
    log_event(log, "daemon.stopped", **({"failed_steps": ",".join(running.failed)} if running.failed else {}))
    return 1 if running.failed else 0


class _Teardown:
    """The steps that close what `_start` opened, run in reverse order when `serve` ends
    (on an AsyncExitStack). A step that raises is logged (`shutdown.step_failed`) and
    the later steps still run; a start that failed keeps its own error as the one raised,
    and a normal stop exits 1 when a step failed."""

    def __init__(self, stack: contextlib.AsyncExitStack):
        self._stack = stack
        self.failed: list[str] = []

    def add(self, name: str, close: Callable, *args) -> None:
        async def step() -> None:
            try:
                done = close(*args)
                if asyncio.iscoroutine(done):
                    await done
            except Exception as e:  # the other steps still run
                self.failed.append(name)
                log_event(log, "shutdown.step_failed", logging.ERROR, step=name, error=f"{type(e).__name__}: {e}")
        self._stack.push_async_callback(step)


async def _start(config: DaemonConfig, loop: asyncio.AbstractEventLoop, running: "_Teardown",
                 reloadable: list, host_memory: tuple[int, str]) -> tuple[Daemon, "HealthServicer"]:
    """Open everything and serve: storage, tokens and TLS, KV events, the Daemon, the gRPC
    server on every address, metrics, then health SERVING. Each part's closing goes on
    `running` as soon as it is open, so that unwinding it stops what runs in the shutdown
    order: gRPC (grace), socket files, the daemon's sessions and namespaces, KV events,
    storage, metrics. Raises StartupError (BadSetting) saying what could not start."""
    metrics = Metrics()
    running.add("metrics", metrics.close)
    storage = _open_storage(config, metrics)
    if storage is not None:
        running.add("storage", storage.close)
    try:
        tokens = Tokens(config.auth_token, config.auth_token_file)
        reloadable_tls = ReloadableTls.open(config.tls_cert, config.tls_key, config.tls_client_ca)
    except (AuthError, TokenFileError) as e:
        raise StartupError(str(e)) from None
    for what, x in (("tokens", tokens if config.auth_token_file else None), ("tls", reloadable_tls)):
        if x is not None:
            reloadable.append((what, x.reload, metrics))
            metrics.reloadable(what)
    tls = reloadable_tls.credentials() if reloadable_tls is not None else None
    events = _open_events(config, loop)
    if events is not None:
        running.add("kv_events", _close_events, events)
    daemon = Daemon(config, metrics, storage, events, host_memory)
    running.add("daemon", daemon.close)
    tokens.on_reloaded = lambda: daemon.close_revoked(tokens.allows)
    metrics.watch(daemon, loop)
    server, health_servicer = _grpc_server(config, daemon, tokens, metrics)

    addresses = _resolve_listen(config)  # once: a fallback is logged once
    bound = []
    running.add("sockets", lambda: _remove_sockets(path for path, _ in bound if path))  # gRPC leaves their files
    for address in addresses:
        bound.append(_bind(server, address, tls))
    await server.start()
    running.add("grpc", _stop_grpc, server, config.shutdown_grace)
    daemon.start()
    for path, _ in bound:
        if path:
            os.chmod(path, 0o660)
    try:
        metrics.serve(config.metrics_host, config.metrics_port)
    except OSError as e:
        raise StartupError(f"cannot serve metrics on {config.metrics_host}:{config.metrics_port}: {e}") from None
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    _freeze_startup_objects()
    log_event(log, "daemon.ready", instance=daemon.instance, listen=",".join(shown for _, shown in bound))
    if storage is not None:
        check_storage(storage, daemon, loop, config.storage_check_interval)
    return daemon, health_servicer


def _open_storage(config: DaemonConfig, metrics: Metrics):
    """The storage backend `--storage` names, or None without one."""
    if not config.storage:
        return None
    try:
        storage = open_storage(config.storage)
    except ValueError as e:
        raise BadSetting(f"--storage {without_passwords(config.storage)!r}: {e}") from None
    except StorageUnavailable as e:
        raise StartupError(f"--storage {without_passwords(config.storage)!r}: {e}") from None
    log_event(log, "storage.opened", store=storage.name, policy=config.storage_policy)
    metrics.add_storage()
    return storage


def _grpc_server(config: DaemonConfig, daemon: Daemon, tokens: Tokens,
                 metrics: Metrics) -> tuple[grpc.aio.Server, "HealthServicer"]:
    """The gRPC server with its interceptors (tokens, RPC limits) and its services: the
    cache, health, reflection, each behind the parse guard (bytes that do not parse are
    refused INVALID_ARGUMENT before any handler runs: service/wire.py)."""
    refused = lambda method: metrics.rpc_requests.labels(method, "RESOURCE_EXHAUSTED").inc()  # noqa: E731
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", config.max_message_size),
                 ("grpc.max_send_message_length", config.max_message_size),
                 ("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=RpcLimit.server_limit(config.max_concurrent_rpcs),
        interceptors=([TokenAuth(tokens, lambda method: metrics.rpc_requests.labels(method, "UNAUTHENTICATED").inc())]
                      if tokens.required else [])
        + [RpcLimit(config.max_concurrent_rpcs, refused),
           RpcLimit(RESERVE // 2, refused, counts=is_other_than_a_check, what="health watches and reflection calls",
                    flag="")],
    )
    services = guarded(server, lambda method: metrics.rpc_requests.labels(method, "INVALID_ARGUMENT").inc())
    pb_grpc.add_RadixKVServicer_to_server(RadixKVServicer(daemon, tokens), services)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, services)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(  # enable_server_reflection, aio, with comments
        CommentedReflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)), services)
    return server, health_servicer


async def _stop_grpc(server: grpc.aio.Server, grace: float) -> None:
    await server.stop(grace)
    log_event(log, "grpc.stopped")


def _close_events(events: EventHub) -> None:
    events.close()
    log_event(log, "kv_events.stopped", **events.stats())
