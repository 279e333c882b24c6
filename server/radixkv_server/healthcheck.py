"""`radixkv-health` / `python -m radixkv_server.healthcheck`: ask a running daemon's gRPC
health service whether it is ready; exit 0 when SERVING, 1 otherwise (not serving,
unreachable, timed out). For container HEALTHCHECKs and Kubernetes exec probes: it
talks over the unix socket, so the gRPC API need not listen on the network.

The address defaults to the daemon's own: the first unix address in RADIXKV_LISTEN,
else its first address (TCP, plaintext), else the default socket. `--service ""` checks
liveness instead of readiness.
Imports grpc only (no torch): a probe runs every few seconds.
"""

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixkv.channel import DEFAULT_TARGET as DEFAULT_SOCKET
from radixkv.channel import resolve_target

from . import __version__

READINESS = "radixkv.v1.RadixKV"


def default_address(environ=os.environ) -> str:
    listen = [a.strip() for a in environ.get("RADIXKV_LISTEN", "").split(",") if a.strip()]
    unix = [a for a in listen if a.startswith("unix:")]
    return (unix or listen or [resolve_target(DEFAULT_SOCKET)])[0]


def check(address: str, service: str = READINESS, timeout: float = 3.0) -> str:
    """The service's status name (SERVING, NOT_SERVING, ...). Raises grpc.RpcError when
    the daemon cannot be reached or does not answer within `timeout` seconds."""
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixkv-health", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=default_address(),
                        help="daemon gRPC address (default: first unix address of RADIXKV_LISTEN, "
                             f"else its first address, else {DEFAULT_SOCKET})")
    parser.add_argument("--service", default=READINESS,
                        help=f'health service name: "{READINESS}" = ready (default), "" = alive')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    args = parser.parse_args(argv)
    address = f"unix://{args.address}" if args.address.startswith("/") else args.address  # grpcurl's form
    try:
        status = check(address, args.service, args.timeout)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:  # the daemon answered: it has no such service
            status = f"UNKNOWN SERVICE (the daemon serves {READINESS!r} and '' only)"
        else:
            status = f"UNREACHABLE ({e.code().name}: {e.details()})"
    if not args.quiet:
        print(f"{args.address} {args.service or '(liveness)'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
