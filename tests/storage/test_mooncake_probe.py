"""What counts as a Mooncake master answering before the store client's setup() (which
holds the GIL for ~60 s against anything that is not an answering master): only a
coro_rpc answer. Services that are not a master stand on localhost sockets here, as an
operator who wrote the wrong port would meet them."""

import socket
import threading
import time

import pytest

from radixkv_server.storage import StorageUnavailable
from radixkv_server.storage.mooncake_probe import probe_master
from radixkv_server.storage.mooncake_store import MooncakeStorage
from tests.storage.fleet import MooncakeMaster, Ticker

TIMEOUT_S = 1.0
SLACK_S = 1.0  # scheduling on a busy 2-core machine
GIL_BOUND_S = 5.0  # setup() against a non-master held the GIL ~60 s


class OtherService:
    """A TCP server on 127.0.0.1 that answers each connection with `reply(request)` and
    closes it (None: closes without a word)."""

    def __init__(self, reply):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self._reply = reply
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                request = conn.recv(64)
                answer = self._reply(request)
                if answer:
                    conn.sendall(answer)

    def close(self):
        self.sock.close()


OTHERS = {
    "closes at once": lambda request: None,
    "an echo": lambda request: request,
    "HTTP": lambda request: b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n",
    # A TLS alert record: content type 21, coro_rpc's magic byte too.
    "TLS": lambda request: b"\x15\x03\x03\x00\x02\x02\x32",
}


@pytest.mark.parametrize("kind", sorted(OTHERS))
def test_a_service_that_is_not_a_master_is_never_taken_for_one(kind):
    other = OtherService(OTHERS[kind])
    try:
        why = probe_master(other.address, TIMEOUT_S)
        assert why is not None and "not a Mooncake master's RPC port" in why and other.address in why
    finally:
        other.close()


def test_a_master_answers_and_its_metrics_port_does_not():
    m = MooncakeMaster().start()
    try:
        assert probe_master(m.address, TIMEOUT_S) is None
        why = probe_master(f"127.0.0.1:{m.metrics_port}", TIMEOUT_S)
        assert why is not None and "did not answer" in why
    finally:
        m.cleanup()


def test_a_daemon_pointed_at_a_service_that_closes_connections_never_freezes():
    """Before: a connection closed without an answer counted as the master answering;
    setup() then held the GIL ~60 s at every join attempt."""
    other = OtherService(OTHERS["closes at once"])
    b = MooncakeStorage(other.address, segment_bytes=0, timeout=TIMEOUT_S)
    ticker = Ticker()
    try:
        for _ in range(2):
            start = time.monotonic()
            with pytest.raises(StorageUnavailable):
                b.check()
            assert time.monotonic() - start < TIMEOUT_S + SLACK_S
            time.sleep(1.1)  # the next join attempt (one a second at most)
        assert ticker.stop() < GIL_BOUND_S
    finally:
        b.close()
        other.close()
