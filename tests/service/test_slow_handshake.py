"""A daemon slow to answer a new connection (just started on a busy machine) gets one
connection from a client, given the time to finish its handshake, not a stream of
attempts each abandoned after 50 ms (what gRPC's `min_reconnect_backoff_ms`, the least
time an attempt is given, made of it at 50)."""

import os
import socket
import threading
import time

from radixkv import Client
from radixkv.messages import MIN_CONNECT_TIMEOUT_MS

HOLD_S = 0.5  # the slow start: each connection is relayed to the daemon only after this


class SlowFront:
    """A Unix socket in front of a daemon's that relays each connection after HOLD_S
    (the injected fault) and counts the connections clients opened."""

    def __init__(self, upstream: str, path: str):
        self.upstream = upstream
        self.accepted = 0
        self._listener = socket.socket(socket.AF_UNIX)
        self._listener.bind(path)
        self._listener.listen()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            self.accepted += 1
            self._open.append(conn)
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, conn: socket.socket) -> None:
        time.sleep(HOLD_S)
        up = socket.socket(socket.AF_UNIX)
        try:
            up.connect(self.upstream)
        except OSError:
            conn.close()
            return
        self._open.append(up)
        threading.Thread(target=_pump, args=(up, conn), daemon=True).start()
        _pump(conn, up)

    def close(self) -> None:
        self._listener.close()
        for s in self._open:
            s.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def test_a_slow_daemon_gets_one_connection_that_completes(daemon, tmp_path):
    assert MIN_CONNECT_TIMEOUT_MS / 1000 > 2 * HOLD_S
    front = SlowFront(daemon.removeprefix("unix://"), os.path.join(tmp_path, "slow.sock"))
    try:
        with Client(f"unix://{tmp_path}/slow.sock", timeout=10, reconnect=None) as client:
            client.wait_ready(10)
            assert client.stats().namespaces == []
        assert front.accepted == 1
    finally:
        front.close()
