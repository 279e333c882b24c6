"""Why a call was refused, in a word an engine can switch on: the `reason` of the
`google.rpc.ErrorInfo` (domain `DOMAIN`) a refused unary call carries in its status
details, and of `CallStatus.reason` on the Session stream.

The status code says what class of thing went wrong and the message says it to a
person; the reason tells apart refusals that share a code but ask the engine for
different actions (a FAILED_PRECONDITION that means "register again" against one that
means "fix your configuration"). A refusal without a reason here carries no ErrorInfo:
its code is all an engine needs. Reasons are part of the wire contract: one may be
added, none renamed; docs/engines.md lists them with what an engine does for each.
`metadata` keys, where a reason has them, are named in its comment.
"""

DOMAIN = "radixkv"

# The session: register again (SESSION_REPLACED: another engine took the namespace).
SESSION_REQUIRED = "SESSION_REQUIRED"  # no session given
SESSION_UNKNOWN = "SESSION_UNKNOWN"  # a session the daemon never had (it restarted since); metadata: session
SESSION_CLOSED = "SESSION_CLOSED"  # closed, closing, or closed while the call waited; metadata: session
SESSION_REPLACED = "SESSION_REPLACED"  # another engine's Register replaced it: do not take the namespace back
STREAM_EXISTS = "STREAM_EXISTS"  # the session has a Session stream already

# Tokens and ownership.
TOKEN_REJECTED = "TOKEN_REJECTED"  # missing or wrong bearer token
NAMESPACE_NOT_GRANTED = "NAMESPACE_NOT_GRANTED"  # the token does not grant it; metadata: namespace
OTHER_SESSION = "OTHER_SESSION"  # another session's (or another token's) session, stream, lease or node
NAMESPACE_SHARED = "NAMESPACE_SHARED"  # other tokens grant it too: only an operator's token may drop it

# Registration against what a namespace holds or who holds it.
NAMESPACE_UNKNOWN = "NAMESPACE_UNKNOWN"  # metadata: namespace
NAMESPACE_BUSY = "NAMESPACE_BUSY"  # its sessions (or ranks) are closing: register again shortly
NAMESPACE_ATTACHED = "NAMESPACE_ATTACHED"  # a live session holds it: replace_existing, or stop that engine
NAMESPACE_MISMATCH = "NAMESPACE_MISMATCH"  # it holds KV of another kind; metadata: field (what differs)
RANKS_MISSING = "RANKS_MISSING"  # tensor-parallel ranks not registered yet; metadata: missing (comma-separated)
NOT_DRIVER_RANK = "NOT_DRIVER_RANK"  # a call only rank 0's session makes
WRONG_ROLE = "WRONG_ROLE"  # a call this session's device tier or role does not make

# Leases, nodes and transfers.
LEASE_UNKNOWN = "LEASE_UNKNOWN"  # released, expired or never taken; metadata: leases (comma-separated)
NODE_UNKNOWN = "NODE_UNKNOWN"  # evicted or never inserted
TRANSFER_UNKNOWN = "TRANSFER_UNKNOWN"  # finished (acked, expired) or never started
COPY_FAILED = "COPY_FAILED"  # the daemon's copy of a transfer failed: recompute its tokens

# Limits and the daemon's state.
LIMIT_REACHED = "LIMIT_REACHED"  # metadata: limit (the daemon's flag that sets it)
HOST_MEMORY_BUDGET = "HOST_MEMORY_BUDGET"  # no room for a new namespace's host pool
SHUTTING_DOWN = "SHUTTING_DOWN"  # register with the daemon's successor
NO_STORAGE = "NO_STORAGE"  # the daemon runs without a storage tier
EVENTS_OFF = "EVENTS_OFF"  # the daemon publishes no KV events

ALL = tuple(v for k, v in sorted(globals().items()) if k.isupper() and k != "DOMAIN" and k != "ALL")
