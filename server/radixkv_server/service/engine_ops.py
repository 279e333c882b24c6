"""The engine operations on a live session, request message in, response message out:
convert the request (`convert`), call the session's namespace, convert the answer.

Written once for both ways an engine calls them: the unary handlers (servicer.py) and
the Session stream (session_stream.py), so both answer alike and fail alike (caller
errors are `ServiceError` / `CacheError`, mapped by `errors.status_of`). Finding the
session, and checking what the caller's token grants, is the caller's.
"""

from radixkv.v1 import radixkv_pb2 as pb

from . import convert
from .daemon import Daemon
from .sessions import Session


async def match(daemon: Daemon, session: Session, request: pb.MatchRequest) -> pb.MatchResponse:
    prompts = convert.prompts(request, daemon.config.max_prompts_per_match)
    answers = await session.namespace.match(session, prompts, request.lease, request.include_storage)
    return convert.match_response(answers)


async def insert(daemon: Daemon, session: Session, request: pb.InsertRequest) -> pb.InsertResponse:
    session.namespace.order_after(session, convert.engine_event(request))
    answer = await session.namespace.insert(session, convert.insert_request(request))
    return convert.insert_response(answer)


async def load_back(daemon: Daemon, session: Session, request: pb.LoadBackRequest) -> pb.LoadBackResponse:
    session.namespace.order_after(session, convert.engine_event(request))
    answer = await session.namespace.load_back(session, request.node, request.device_pages,
                                               lease=request.lease, start_page=request.start_page,
                                               wait=request.wait)
    return convert.load_back_response(answer)


async def release(daemon: Daemon, session: Session, request: pb.ReleaseRequest) -> pb.ReleaseResponse:
    session.namespace.release(session, list(request.leases))
    return pb.ReleaseResponse()


async def evict(daemon: Daemon, session: Session, request: pb.EvictRequest) -> pb.EvictResponse:
    session.namespace.order_after(session, convert.engine_event(request))
    return convert.evict_response(await session.namespace.evict(request.num_pages))


def echo(request: pb.EchoRequest) -> pb.EchoResponse:
    """Needs no session: the floor cost of a call."""
    return pb.EchoResponse(payload=request.payload)


__all__ = ["echo", "evict", "insert", "load_back", "match", "release"]
