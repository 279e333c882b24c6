"""A refusal's status fits the trailer a gRPC client takes whole, whatever string of
the caller's it quotes (test_bad_input.py has the daemon's answers themselves)."""

import base64

import grpc
import pytest

from radixkv_server.service import reasons
from radixkv_server.service.errors import ServiceError, status_of

C = grpc.StatusCode


@pytest.mark.parametrize("quoted", ["s" * 20_000, "\U0001F600" * 20_000, "%" * 20_000, "\u00e9" * 20_000])
def test_a_refusal_quoting_any_huge_string_fits_the_trailer_a_client_takes_whole(quoted):
    """gRPC clients take a trailer whole only under 8 KiB (past it they refuse a growing
    share at random: RESOURCE_EXHAUSTED "metadata size exceeds soft limit"). A 20k emoji
    session id made one of 9,376 bytes: its message cut to 2,000 UTF-8 bytes took 6,000
    percent-encoded, and the details repeated it; test_bad_input's row of it failed about one run in
    ten."""
    refusal = status_of(ServiceError(C.UNAUTHENTICATED, f"unknown session {quoted!r}; register again",
                                     reasons.SESSION_UNKNOWN, session=quoted))
    trailer = refusal.trailer()
    percent_encoded = sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in refusal.message.encode())
    size = len("grpc-status: 16") + len("grpc-message: ") + percent_encoded
    size += sum(len(key) + 2 + len(base64.b64encode(value)) for key, value in trailer)
    assert "(cut: 20" in refusal.message and size < 7 * 1024
