"""Tenants sharing a host's /dev/shm: a token's engines name only their own segments.

Without `uid=` on a token, a Register may name any segment the daemon can open, another
tenant's included: the daemon then reads that tenant's KV into the caller's namespace
(an Insert) or writes over it (a LoadBack). With `uid=N` every segment a Register names
must belong to user N (a real daemon with a token file; the tests run as root, so a
segment changes owner with chown).
"""

import os

import pytest

from radixkv import errors
from radixkv.client import Client
from radixkv_server.service.tenants import TokenFileError, parse_token_file
from tests.support.engine import EngineDouble, prompt

ALICE, BOB, OPERATOR = "alice-1c9e", "bob-77ad", "op-51f0"
ALICE_UID, BOB_UID = 4242, 4343


@pytest.fixture
def daemon(daemon_factory, tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"{ALICE} alice/* uid={ALICE_UID}\n{BOB} bob/* uid={BOB_UID}\n{OPERATOR}\n")
    return daemon_factory("--auth-token-file", str(path))


def owned_by(uid: int, num_pages: int = 32) -> EngineDouble:
    engine = EngineDouble(num_pages=num_pages)
    os.chown(f"/dev/shm/{engine.shm_name}", uid, -1)
    return engine


def test_a_tenant_cannot_name_another_tenants_segment(daemon):
    bob = owned_by(BOB_UID)
    alice = owned_by(ALICE_UID)
    try:
        bob.register(Client(daemon.target, timeout=10, token=BOB), "bob/m")
        bob.prefill(prompt(1))
        with Client(daemon.target, timeout=10, token=ALICE) as c:
            with pytest.raises(errors.PermissionDenied, match=f"belongs to uid {BOB_UID}.*only segments of uid {ALICE_UID}"):
                c.register("alice/m", bob.layout, bob.buffers.specs, 32)
        alice.register(Client(daemon.target, timeout=10, token=ALICE), "alice/m")  # her own: fine
        assert alice.prefill(prompt(2)).redundant_pages.tolist() == []
        assert bob.load(prompt(1)) == (len(prompt(1)), (0, 0))  # his KV, untouched
    finally:
        alice.close()
        bob.close()


def test_an_operator_token_without_uid_names_any_segment(daemon):
    engine = owned_by(BOB_UID)
    try:
        engine.register(Client(daemon.target, timeout=10, token=OPERATOR), "anything/m")
    finally:
        engine.close()


@pytest.mark.parametrize("line, says", [("tok a/* uid=1 uid=2", "at most one uid="),
                                         ("tok uid=root", "uid= takes a number"), ("tok uid=-1", "uid= takes a number")])
def test_a_bad_uid_in_the_token_file_is_refused(line, says):
    with pytest.raises(TokenFileError, match=says):
        parse_token_file(line, "tokens")


def test_uid_is_not_a_namespace_pattern():
    [grant] = parse_token_file("tok uid=7", "tokens").values()
    assert grant.everything and grant.segment_uid == 7
    [grant] = parse_token_file("tok a/* uid=7 b/*", "tokens").values()
    assert grant.patterns == ("a/*", "b/*") and grant.segment_uid == 7
