"""ClusterBatch: single-key commands sent over a Redis Cluster node by node, each node once.

redis-py's ClusterPipeline re-sends every command that failed on its own, each with the
client's retries and socket timeouts: against one frozen master a 256-page GET lasted
minutes, and a master that refused connections failed the whole pipeline. Here the keys
are grouped by the node that serves their slot (redis-py's slot map), every node's
commands are written before any reply is read (redis-py's `NodeCommands`, as its own
pipeline does), and each node is tried once: a node that is refused, resets or does not
answer within the socket timeout fails only its own keys, and is not asked again by the
same ClusterBatch. redis-py's node clients do not retry (it makes their connections with
`retries=0` since redis-py 6), so a failing node costs at most a connect timeout plus a
socket timeout.

Redirections (resharding, failover): a key answered MOVED is sent once more to the node
the reply names, one answered ASK once more to the node it names, after ASKING. A key
redirected again, or to a node the client does not know, fails: it is never read from a
node that does not hold it. A redirection, a failed node and an uncovered slot all set
`wants_refresh`; the owner's `refresh` then re-reads the slot map (once per ClusterBatch),
and a key whose node failed or whose slot was uncovered is sent once more where the new
map puts it, unless that node failed too (a replica promoted in the meantime serves it).
"""

import time
from dataclasses import dataclass

from redis.cluster import ClusterNode, NodeCommands, PipelineCommand, RedisCluster, get_connection
from redis.exceptions import AskError, ClusterDownError, ConnectionError, MovedError, SlotNotCoveredError, TimeoutError

# A node that did not answer, as opposed to one that refused a command.
NODE_FAILURES = (ConnectionError, TimeoutError, OSError)


class DeadlineExceeded(TimeoutError):
    """A command not sent because its call's deadline had passed."""


# Replies that say the command reached no node that holds its slot.
_UNSENT = NODE_FAILURES + (SlotNotCoveredError,)


@dataclass(slots=True)
class _Send:
    index: int                        # position of the command in the batch
    node: ClusterNode | None = None   # where a redirection sends it; None: by its slot
    asking: bool = False              # an ASK redirection: ASKING goes first


class ClusterBatch:
    """The batches of one backend call: they share its deadline and its record of failed
    nodes (a node that failed in one batch is not asked again in the next). Not shared
    between threads: one per call."""

    def __init__(self, client: RedisCluster, deadline: float, refresh=None):
        self._client = client
        self._deadline = deadline             # time.monotonic() past which nothing is sent
        self._refresh = refresh               # re-reads the slot map; called once at most
        self.failed: dict[str, Exception] = {}  # node name -> why it failed
        self.answered: set[str] = set()       # names of the nodes that answered
        self.wants_refresh = False            # the slot map looks stale

    def run(self, commands: list[tuple]) -> list:
        """The replies to `commands` (argument tuples with the key second, ("GET", key)),
        in order. A command that got no usable reply has an exception in its place: its
        node's connection error or timeout, SlotNotCoveredError, DeadlineExceeded, a
        redirection it could not follow, or the error the node answered. Raises nothing
        for a node's failure; other exceptions (a bug) propagate."""
        replies: list = [None] * len(commands)
        todo = [_Send(i) for i in range(len(commands))]
        for _ in range(2):  # the commands, then once more those redirected
            todo = self._send(commands, todo, replies)
            if not todo:
                break
        if self.wants_refresh and self._refresh is not None:
            refresh, self._refresh = self._refresh, None
            refresh()
            # A failover may have given a failed node's slots to a promoted replica: the
            # keys whose slot the map now puts on a node that has not failed go there once.
            unsent = [_Send(i) for i, r in enumerate(replies) if isinstance(r, _UNSENT)]
            if unsent:
                self._send(commands, unsent, replies)
        return replies

    def _send(self, commands: list[tuple], todo: list[_Send], replies: list) -> list[_Send]:
        """One pipeline per node for `todo`; fills `replies`; returns the redirected."""
        groups: dict[str, tuple[ClusterNode, list[_Send]]] = {}
        for send in todo:
            node = self._node_for(send, commands[send.index][1], replies)
            if node is not None:
                groups.setdefault(node.name, (node, []))[1].append(send)
        pipes = self._open(groups, commands, replies)
        written = read = 0
        try:
            for _, pipe in pipes:
                pipe.write()
                written += 1
            for _, pipe in pipes:
                pipe.read()
                read += 1
        finally:
            for n, (_, pipe) in enumerate(pipes):
                if read <= n < written:  # replies left unread would reach its next user
                    pipe.connection.disconnect()
                pipe.connection_pool.release(pipe.connection)
        return self._settle(pipes, replies)

    def _node_for(self, send: _Send, key, replies: list) -> ClusterNode | None:
        """Where `send` goes, or None with its reply set to why it is not sent."""
        if time.monotonic() >= self._deadline:
            replies[send.index] = DeadlineExceeded("the call's deadline passed before it was sent")
            return None
        try:
            node = send.node or self._client.get_node_from_key(key)
        except SlotNotCoveredError as e:
            replies[send.index] = e
            self.wants_refresh = True
            return None
        if node.name in self.failed:
            replies[send.index] = self.failed[node.name]
            return None
        return node

    def _open(self, groups: dict, commands: list[tuple], replies: list) -> list:
        """(name, NodeCommands on a connection from the node's pool) for each node that
        could be connected to, its commands queued; the others' commands fail."""
        pipes = []
        for name, (node, sends) in groups.items():
            redis_node = self._client.get_redis_connection(node)
            try:
                connection = get_connection(redis_node)
            except NODE_FAILURES as e:
                self._fail(name, e)
                for send in sends:
                    replies[send.index] = e
                continue
            pipe = NodeCommands(redis_node.parse_response, redis_node.connection_pool, connection)
            for send in sends:
                if send.asking:  # the ASKING flag covers the next command only
                    pipe.append(PipelineCommand(("ASKING",), position=-1))
                pipe.append(PipelineCommand(commands[send.index], position=send.index))
            pipes.append((name, pipe))
        return pipes

    def _settle(self, pipes: list, replies: list) -> list[_Send]:
        """Copy the replies read into `replies`; note failed nodes; the redirected."""
        redirected = []
        for name, pipe in pipes:
            failed = False
            for command in pipe.commands:
                if command.position < 0:  # ASKING's own reply
                    continue
                reply = replies[command.position] = command.result
                if isinstance(reply, NODE_FAILURES):
                    failed = True
                    self._fail(name, reply)
                elif isinstance(reply, (MovedError, AskError)):
                    self.wants_refresh = True
                    target = self._client.get_node(host=reply.host, port=reply.port)
                    if target is not None and target.name not in self.failed:
                        redirected.append(_Send(command.position, target, isinstance(reply, AskError)))
                elif isinstance(reply, ClusterDownError):
                    self.wants_refresh = True
            if not failed:
                self.answered.add(name)
        return redirected

    def _fail(self, name: str, error: Exception) -> None:
        self.failed.setdefault(name, error)
        self.wants_refresh = True
