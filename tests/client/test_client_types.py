"""Client values without a daemon: packing, result conversion, error mapping."""

from array import array

import grpc
import numpy as np
import pytest

from radixkv import errors
from radixkv.layout import KvLayout
from radixkv.messages import (buffer_pb, insert_request, match_request, prefetch_request, register_again,
                              register_request, transfer_ids)
from radixkv.types import (InsertResult, LoadBackResult, LoadOutcome, MatchResult, Prompt, as_packed,
                           pack, unpack)
from radixkv.v1 import radixkv_pb2 as pb


def test_pack_is_little_endian_int32():
    assert pack([1, -1, 0x01020304]) == b"\x01\x00\x00\x00\xff\xff\xff\xff\x04\x03\x02\x01"
    assert list(unpack(pack([5, 6, 7]))) == [5, 6, 7]
    assert unpack(b"").tolist() == []
    with pytest.raises(ValueError):
        unpack(b"\x00\x00\x00")
    with pytest.raises(OverflowError):
        pack([1 << 31])


def test_as_packed_accepts_lists_arrays_bytes_and_tensors():
    import torch

    want = pack([3, 4, 5])
    assert as_packed([3, 4, 5]) == want
    assert as_packed(array("i", [3, 4, 5])) == want
    assert as_packed(array("q", [3, 4, 5])) == want
    assert as_packed(want) is want
    assert as_packed(bytearray(want)) == want
    assert as_packed(torch.tensor([3, 4, 5], dtype=torch.int64)) == want
    assert as_packed(torch.tensor([3, 4, 5], dtype=torch.int32)) == want
    for dtype in ("int64", "int32", "uint16"):
        assert as_packed(np.array([3, 4, 5], dtype=dtype)) == want
    assert as_packed(np.array([[3, 4], [5, 6]])) == pack([3, 4, 5, 6])  # whole arrays, flattened
    assert as_packed(np.array([], dtype=np.int64)) == b""
    assert Prompt.of([3, 4, 5]) == Prompt(want)
    assert Prompt.of(np.array([3, 4, 5])) == Prompt(want)
    assert Prompt.of(Prompt(want, b"lora")).extra_key == b"lora"


@pytest.mark.parametrize("bad, error", [
    ("list", OverflowError), ("np", OverflowError), ("np-negative", OverflowError), ("torch", OverflowError),
    ("np-float", TypeError), ("torch-float", TypeError)])
def test_as_packed_refuses_what_int32_cannot_carry(bad, error):
    import torch
    value = {"list": [1 << 31], "np": np.array([1 << 31]), "np-negative": np.array([-(1 << 31) - 1]),
             "torch": torch.tensor([1 << 40]), "np-float": np.array([1.5]), "torch-float": torch.tensor([1.0])}[bad]
    with pytest.raises(error):
        as_packed(value)  # never a silently wrapped token id
    # A request built from it says so as the client's InvalidArgument, naming the field.
    with pytest.raises(errors.InvalidArgument, match="prompt 0"):
        match_request("s", [value], False)
    with pytest.raises(errors.InvalidArgument, match="device_pages"):
        insert_request("s", [1, 2, 3, 4], value, extra_key=b"", chunked=False, release_lease=0, lease=False)


def test_results_expose_pages_as_int_arrays():
    m = MatchResult.from_pb(pb.MatchResult(device_pages=pack([7, 8]), device_tokens=32, host_tokens=16,
                                           device_node=3, host_node=4, depends_on=[9], lease=2))
    assert m.device_pages == array("i", [7, 8]) and m.depends_on == (9,) and m.lease == 2
    lb = LoadBackResult.from_pb(pb.LoadBackResponse(transfer=5, device_pages=pack([1, 2, 3]), device_tokens=48,
                                                    loaded_tokens=16, depends_on=[4], unused_pages=pack([6])))
    assert (lb.transfer, list(lb.device_pages), list(lb.unused_pages), lb.depends_on) == (5, [1, 2, 3], [6], (4,))
    ins = InsertResult.from_pb(pb.InsertResponse(cached_tokens=16, redundant_pages=pack([2]), node=8))
    assert list(ins.redundant_pages) == [2] and ins.lease == 0
    with pytest.raises(AttributeError):
        m.lease = 3  # frozen


def test_load_outcome_is_ok_only_when_the_daemon_says_so():
    assert LoadOutcome.from_pb(pb.AckResponse(transfer=3)).ok
    failed = LoadOutcome.from_pb(pb.AckResponse(transfer=3, load_failed=True, message="copy failed",
                                                failed_pages=pack([4, 5])))
    assert not failed.ok and failed.reason == "copy failed" and list(failed.failed_pages) == [4, 5]
    refused = LoadOutcome.from_pb(pb.AckResponse(transfer=3, code=5, message="unknown transfer"))
    assert not refused.ok and "NOT_FOUND" in refused.reason and "unknown transfer" in refused.reason


def test_requests_are_built_from_python_values():
    layout = KvLayout(2, 4, 8, "float16", 16)
    req = register_request("m/tp0", layout, [("seg0", 0, 1024), (b"seg1", 64, 1024)], 10,
                           backend="shm", device=0, write_policy="write_back", host_pool_pages=0,
                           replace_existing=False, engine="test", model="")
    assert req.layout.page_size == 16 and req.layout.kv_format == "mha"
    assert [(b.handle, b.offset, b.size) for b in req.buffers] == [(b"seg0", 0, 1024), (b"seg1", 64, 1024)]
    m = match_request("s", [[1, 2], Prompt(pack([3]), b"k")], lease=True)
    assert [p.tokens for p in m.prompts] == [pack([1, 2]), pack([3])] and m.prompts[1].extra_key == b"k"
    ins = insert_request("s", [1, 2], array("i", [9]), extra_key=b"", chunked=False, release_lease=4, lease=False)
    assert ins.device_pages == pack([9]) and ins.release_lease == 4
    assert transfer_ids([3, 0, 3, 1]) == [3, 1]
    with pytest.raises(errors.InvalidArgument):
        buffer_pb(("seg", 0))
    with pytest.raises(errors.InvalidArgument):
        register_request("m", "not a layout", [], 1, backend="shm", device=0, write_policy="",
                         host_pool_pages=0, replace_existing=False, engine="", model="")


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("code, cls", [
    (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
    (grpc.StatusCode.NOT_FOUND, errors.NotFound),
    (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPrecondition),
    (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
    (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDenied),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
    (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
    (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
    (grpc.StatusCode.INTERNAL, errors.Internal),
])
def test_status_codes_map_to_their_exception(code, cls):
    e = errors.from_rpc_error(_FakeRpcError(code, "why"))
    assert type(e) is cls and e.code is code and e.message == "why"
    assert isinstance(e, errors.RadixKVError) and str(e) == f"{code.name}: why"


def test_unmapped_status_keeps_its_code():
    e = errors.from_rpc_error(_FakeRpcError(grpc.StatusCode.ABORTED, "x"))
    assert type(e) is errors.RadixKVError and e.code is grpc.StatusCode.ABORTED
    assert errors.code_from_int(7) is grpc.StatusCode.PERMISSION_DENIED


def test_a_prefetch_timeout_goes_out_in_whole_milliseconds_never_zero():
    """0 ms on the wire means no timeout, which the daemon refuses for this policy: a
    timeout under half a millisecond went out as 0."""
    assert prefetch_request("s", [1, 2], extra_key=b"", policy="timeout", timeout=0.0004).timeout_ms == 1
    assert prefetch_request("s", [1, 2], extra_key=b"", policy="timeout", timeout=0.25).timeout_ms == 250
    assert prefetch_request("s", [1, 2], extra_key=b"", policy="wait_complete", timeout=3.0).timeout_ms == 0
    for bad in (None, 0, -1.0):
        with pytest.raises(errors.InvalidArgument, match="timeout policy needs a timeout"):
            prefetch_request("s", [1, 2], extra_key=b"", policy="timeout", timeout=bad)


def test_registering_again_waits_for_the_other_ranks_no_longer_than_the_reconnect_allows():
    layout = KvLayout(2, 4, 8, "float16", 16)
    first = register_request("m", layout, [("seg0", 0, 1024)], 10, backend="shm", device=0, write_policy="",
                             host_pool_pages=0, replace_existing=False, engine="", model="", tp_rank=1,
                             tp_size=2, instance="e", wait_for_ranks=5.0)
    assert first.wait_for_ranks_ms == 5000
    assert register_again(first, [], replaced=False) is first  # as first sent
    assert register_again(first, [], replaced=False, wait_left=1.25).wait_for_ranks_ms == 1250
    assert register_again(first, [], replaced=False, wait_left=-2.0).wait_for_ranks_ms == 0
    assert register_again(first, [], replaced=False, wait_left=60.0) is first
    assert first.wait_for_ranks_ms == 5000  # the request kept for the next time is not changed
    for bad in (-1, float("inf"), float("nan"), None, 5_000_000):
        with pytest.raises(errors.InvalidArgument, match="wait_for_ranks .*: seconds from 0 to 4294967"):
            register_request("m", layout, [], 1, backend="shm", device=0, write_policy="", host_pool_pages=0,
                             replace_existing=False, engine="", model="", wait_for_ranks=bad)


def test_a_prompt_given_where_a_batch_belongs_is_refused_not_read_as_one_token_prompts():
    """match(np.array(tokens)) took each token for a prompt: twelve misses and no error."""
    import numpy as np
    import torch

    for tokens in (np.arange(3, 15), torch.arange(3, 15)):
        with pytest.raises(errors.InvalidArgument, match="one token .* Match takes a batch of prompts"):
            match_request("s", tokens, lease=False)
        assert len(match_request("s", [tokens], lease=False).prompts) == 1
