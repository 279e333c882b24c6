"""Operators' calls as plans (`radixkv.session`): Stats, Inspect, CheckInvariants,
DropNamespace and Echo need no session of their own. Each takes the session's `call`
(its call path, with recovery) and returns what the clients' methods return."""

from radixkv.v1 import radixkv_pb2 as pb

from .plans import Plan
from .types import Violation


def stats(call, namespace: str) -> Plan[pb.StatsResponse]:
    return (yield from call("Stats", pb.StatsRequest(namespace=namespace)))


def inspect(call, namespace: str, max_nodes: int) -> Plan[pb.InspectResponse]:
    return (yield from call("Inspect", pb.InspectRequest(namespace=namespace, max_nodes=max_nodes)))


def check_invariants(call, namespace: str) -> Plan[list[Violation]]:
    resp = yield from call("CheckInvariants", pb.CheckInvariantsRequest(namespace=namespace))
    return [Violation(v.namespace, v.message) for v in resp.violations]


def drop_namespace(call, namespace: str, store: bool) -> Plan[pb.DropNamespaceResponse]:
    return (yield from call("DropNamespace", pb.DropNamespaceRequest(namespace=namespace, store=store)))


def echo(call, payload: bytes) -> Plan[bytes]:
    return (yield from call("Echo", pb.EchoRequest(payload=payload))).payload


__all__ = ["check_invariants", "drop_namespace", "echo", "inspect", "stats"]
