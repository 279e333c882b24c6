"""The token file's options, through a real daemon.

`tenant=NAME`: a tenant rotating its token gives the old and the new token's lines one
tenant, so an engine restarted with the new token may replace the session the old one's
engine left (before, a session was its token's alone: PERMISSION_DENIED until it timed
out). Another tenant granted the same namespaces still may not; removing the old token
still closes the sessions it registered, and the new token's stay.

`namespaces=N`, `host=SIZE`, `sessions=N`: a tenant's quota; a Register past it is
RESOURCE_EXHAUSTED with the reason LIMIT_REACHED naming the option. Stats names the
tenant of each namespace and session, to that tenant and to operators.
"""

import signal

import grpc
import pytest

from radixkv import errors
from radixkv.client import Client
from radixkv.types import pack
from radixkv_server.service.tenants import TokenFileError, parse_token_file
from tests.support.daemon import wait_for
from tests.support.engine import EngineDouble, prompt

OLD, NEW, DAVE = "carol-old-1f", "carol-new-9c", "dave-4e"
TOKEN_FILE = f"""{OLD}   carol/*  tenant=carol
{NEW}   carol/*  tenant=carol
{DAVE}  dave/*  carol/*     # shares carol's namespaces, but is not carol
"""


def engine_of(target: str, token: str, namespace: str, **register) -> EngineDouble:
    engine = EngineDouble(num_pages=32)
    engine.register(Client(target, timeout=10, token=token), namespace, **register)
    return engine


def test_a_tenants_new_token_replaces_the_session_its_old_token_registered(daemon_factory, tmp_path):
    token_file = tmp_path / "tokens"
    token_file.write_text(TOKEN_FILE)
    d = daemon_factory("--auth-token-file", str(token_file))
    old = engine_of(d.target, OLD, "carol/m")  # its engine hung: the session is still live
    other = engine_of(d.target, OLD, "carol/m2")  # an engine not restarted yet
    new = None
    try:
        old.prefill(prompt(1, pages=4))
        with pytest.raises(errors.PermissionDenied, match="registered with another token"):
            engine_of(d.target, DAVE, "carol/m", replace_existing=True)
        new = engine_of(d.target, NEW, "carol/m", replace_existing=True)
        assert new.registration.warm
        [m] = new.client.match([pack(prompt(1, pages=4))])
        assert m.device_tokens + m.host_tokens == 16  # the old engine's KV, kept
        with pytest.raises(errors.RadixKVError):  # the old engine's session is gone
            old.client.match([pack(prompt(1, pages=4))])
        # The rotation ends: the old token leaves the file. Its remaining session ends with it.
        token_file.write_text(TOKEN_FILE.replace(f"{OLD}   carol/*  tenant=carol\n", ""))
        d.signal(signal.SIGHUP)
        wait_for(lambda: "event=auth.reloaded" in d.log(), 10, "the token file reloaded")
        wait_for(lambda: "no longer grants the namespace" in d.log(), 10, "the old token's session closed")
        with pytest.raises(errors.RadixKVError) as gone:
            other.client.match([pack(prompt(2))])
        assert gone.value.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.ABORTED)
        new.client.match([pack(prompt(1, pages=4))])  # the new token's session stays
    finally:
        for e in (old, other, new):
            if e is not None:
                e.close()


@pytest.mark.parametrize("line, says", [("tok a/* tenant=", "tenant= takes a name"),
                                         ("tok tenant=x tenant=y", "at most one tenant="),
                                         ("tok a/* tennant=x", "unknown option tennant=")])
def test_a_token_line_with_a_bad_option_is_refused_saying_so(line, says):
    with pytest.raises(TokenFileError, match=says):
        parse_token_file(line, "tokens")


def test_tokens_of_one_tenant_are_one_owner_and_others_are_not():
    grants = list(parse_token_file(TOKEN_FILE, "tokens").values())
    assert grants[0].owner == grants[1].owner != grants[2].owner
    assert len({g.token for g in grants}) == 3 and grants[0].patterns == ("carol/*",)


def test_a_register_past_the_tenants_quota_is_refused_naming_the_option(daemon_factory, tmp_path):
    token_file = tmp_path / "tokens"
    token_file.write_text(f"{OLD} carol/* tenant=carol namespaces=1\n{NEW} carol/* tenant=carol namespaces=1\n")
    d = daemon_factory("--auth-token-file", str(token_file), "--reclaim-detached-after", "0")
    first = engine_of(d.target, OLD, "carol/a")
    try:
        with pytest.raises(errors.ResourceExhausted, match="namespaces=1 in the token file") as refused:
            engine_of(d.target, NEW, "carol/b")  # the tenant's, whichever of its tokens
        assert refused.value.reason == "LIMIT_REACHED" and refused.value.metadata == {"limit": "namespaces="}
    finally:
        first.close()


def test_one_tenants_lines_must_give_one_quota():
    with pytest.raises(TokenFileError, match="tenant carol has another quota on line 1"):
        parse_token_file("a carol/* tenant=carol host=1GiB\nb carol/* tenant=carol host=2GiB", "tokens")
    [grant] = parse_token_file("a carol/* host=1.5GiB namespaces=3 sessions=9", "tokens").values()
    assert (grant.quota.host_bytes, grant.quota.namespaces, grant.quota.sessions) == (int(1.5 * 2**30), 3, 9)
    with pytest.raises(TokenFileError, match="sessions= takes a number"):
        parse_token_file("a carol/* sessions=many", "tokens")


def test_stats_names_each_namespaces_and_sessions_tenant_to_it_and_to_operators_only(daemon_factory, tmp_path):
    """An operator sees whose namespaces and sessions they are (the quota's holders);
    a tenant sees its own named, and another tenant's in a namespace they share as ""."""
    token_file = tmp_path / "tokens"
    token_file.write_text(TOKEN_FILE + "op-77  # the operator\n")
    d = daemon_factory("--auth-token-file", str(token_file))
    carols = engine_of(d.target, OLD, "carol/m")
    daves = engine_of(d.target, DAVE, "dave/m")
    try:
        def tenants(token: str) -> dict:
            stats = Client(d.target, timeout=10, token=token).stats()
            return {ns.namespace: (ns.tenant, [s.tenant for s in ns.sessions]) for ns in stats.namespaces}
        assert tenants("op-77") == {"carol/m": ("carol", ["carol"]), "dave/m": ("line 3", ["line 3"])}
        assert tenants(NEW) == {"carol/m": ("carol", ["carol"])}  # carol's other token: carol still
        assert tenants(DAVE)["carol/m"] == ("", [""]) and tenants(DAVE)["dave/m"] == ("line 3", ["line 3"])
    finally:
        carols.close()
        daves.close()
