"""The engine operations on a live session, request message in, response message out:
convert the request (`convert`), call the session's namespace, convert the answer.

Written once for both ways an engine calls them: the unary handlers (servicer.py) and
the Session stream (session_stream.py), so both answer alike and fail alike (caller
errors are `ServiceError` / `CacheError`, mapped by `errors.status_of`). Finding the
session, and checking what the caller's token grants, is the caller's.

Each operation fills the response message it is given (`out`, a fresh one by default)
and returns it: the Session stream passes the field of its SessionResponse, so an answer
is built once, in place, never copied into the message that carries it.
"""

from radixkv.v1 import radixkv_pb2 as pb

from . import convert
from .daemon import Daemon
from .sessions import Session


async def match(daemon: Daemon, session: Session, request: pb.MatchRequest,
                out: pb.MatchResponse | None = None) -> pb.MatchResponse:
    prompts = convert.prompts(request, daemon.config.max_prompts_per_match, daemon.config.max_extra_key_bytes)
    answers = await session.namespace.match(session, prompts, request.lease, request.include_storage)
    return convert.match_response(answers, pb.MatchResponse() if out is None else out)


async def insert(daemon: Daemon, session: Session, request: pb.InsertRequest,
                 out: pb.InsertResponse | None = None) -> pb.InsertResponse:
    session.namespace.order_after(session, convert.engine_event(request))
    answer = await session.namespace.insert(session, convert.insert_request(request, daemon.config.max_extra_key_bytes))
    return convert.insert_response(answer, pb.InsertResponse() if out is None else out)


async def load_back(daemon: Daemon, session: Session, request: pb.LoadBackRequest,
                    out: pb.LoadBackResponse | None = None) -> pb.LoadBackResponse:
    session.namespace.order_after(session, convert.engine_event(request))
    answer = await session.namespace.load_back(session, request.node, request.device_pages,
                                               lease=request.lease, start_page=request.start_page,
                                               wait=request.wait)
    return convert.load_back_response(answer, pb.LoadBackResponse() if out is None else out)


async def release(daemon: Daemon, session: Session, request: pb.ReleaseRequest,
                  out: pb.ReleaseResponse | None = None) -> pb.ReleaseResponse:
    session.namespace.release(session, [lease for lease in request.leases if lease])  # 0: no lease (a miss's)
    return pb.ReleaseResponse() if out is None else out


async def evict(daemon: Daemon, session: Session, request: pb.EvictRequest,
                out: pb.EvictResponse | None = None) -> pb.EvictResponse:
    session.namespace.order_after(session, convert.engine_event(request))
    answer = await session.namespace.evict(session, request.num_pages)
    return convert.evict_response(answer, pb.EvictResponse() if out is None else out)


def echo(request: pb.EchoRequest, out: pb.EchoResponse | None = None) -> pb.EchoResponse:
    """Needs no session: the floor cost of a call."""
    out = pb.EchoResponse() if out is None else out
    out.payload = request.payload
    return out


__all__ = ["echo", "evict", "insert", "load_back", "match", "release"]
