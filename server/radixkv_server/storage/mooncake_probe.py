"""Whether a Mooncake master answers, asked without the store client (for MooncakeStorage).

The store client's `setup()` and `close()` hold the GIL while they wait for the master
(measured with the 0.3.13 wheel: ~60 s against a master that accepts connections but
does not answer, every thread of the daemon frozen, the gRPC loop included). So before
either is called, `probe_master` asks the master itself, from Python, on a socket with a
deadline (which releases the GIL while it waits): it sends one coro_rpc request (the
master's RPC protocol) for a function the master does not have. A running master answers
it at once with an error ("the rpc function not registered"); one that is stopped,
hung or overloaded leaves it unanswered.

Only an answer in coro_rpc's form counts (its magic byte first and our sequence number
echoed, not our own request sent back). Anything else is refused, since trusting it costs a frozen daemon: a port
that is not the master's RPC port (its admin/metrics port, another service), a server
that closes the connection without answering, or this socket connected to itself (a
local master that is down: Linux can hand out its port as our source port).
"""

import socket
import struct
import time

# coro_rpc request header (yalantinglibs): magic 21, version, serialize type, message
# type, then sequence number, function id, body length, attachment length (little endian).
_MAGIC = 21
_SEQ = 0x5241444B  # echoed in the answer; any value
_NO_FUNCTION = 0   # a function id the master does not register
REQUEST = struct.pack("<BBBBIIII", _MAGIC, 0, 0, 0, _SEQ, _NO_FUNCTION, 0, 0)
_ANSWER_HEAD = 8  # an answer's magic, version, error code, message type and sequence number


def probe_master(master: str, seconds: float) -> str | None:
    """None when the master at `master` ("host:port") answered an RPC within `seconds`
    (connecting included); else why not, for a log line. Blocks the calling thread for
    at most about `seconds`, never holding the GIL while it waits; touches no state."""
    host, _, port = master.rpartition(":")
    deadline = time.monotonic() + seconds
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=seconds)
    except OSError as exc:  # refused, unreachable, or no answer to the connect (socket.timeout)
        return f"the master at {master} does not accept connections ({exc or type(exc).__name__})"
    with sock:
        if sock.getsockname() == sock.getpeername():
            return f"the master at {master} does not accept connections (the socket connected to itself)"
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(REQUEST)
            answer = b""
            while len(answer) < _ANSWER_HEAD:  # the answer's head may come in pieces
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                piece = sock.recv(64)
                if not piece:
                    break
                answer += piece
        except socket.timeout:
            return (f"the master at {master} accepts connections but did not answer within {seconds:g}s "
                    "(stopped, hung or overloaded)")
        except OSError as exc:
            return f"the master at {master} dropped the connection ({exc})"
    if not answer:
        return (f"the service at {master} closed the connection without answering: "
                "not a Mooncake master's RPC port (--rpc_port)")
    if answer[0] != _MAGIC or answer[4:8] != REQUEST[4:8] or REQUEST.startswith(answer):
        return (f"the service at {master} answered in another protocol ({answer[:8]!r}): "
                "not a Mooncake master's RPC port (--rpc_port)")
    return None
