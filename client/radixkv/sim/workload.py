"""Seeded request streams for the simulator: multi-turn chats and shared prefixes.

Time is counted in scheduler steps. A workload hands out requests whose arrival time
has come (`take`), takes back the ones the engine could not run yet (`defer`), and
learns when one finished (`finish`), which is when a chat's next turn is written.
"""

import heapq
import random
from collections import deque
from dataclasses import dataclass

from ..types import pack

VOCAB = 32000


@dataclass(frozen=True, slots=True)
class Request:
    """One request: `tokens` (packed int32) are the prompt followed by the output the
    engine "generates"; only the prompt is matched, all of it is computed and cached."""

    rid: int
    client: int
    tokens: bytes
    prompt_tokens: int
    extra_key: bytes = b""

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4

    @property
    def prompt(self) -> bytes:
        return self.tokens[: self.prompt_tokens * 4]


class Workload:
    """Arrival bookkeeping shared by the workloads. `rate` makes arrivals Poisson (mean
    arrivals per step: per chat for MultiTurn, in all for SharedPrefix); None makes
    every arrival immediate."""

    def __init__(self, num_requests: int, seed: int, rate: float | None):
        if num_requests < 0:
            raise ValueError(f"num_requests must be >= 0, got {num_requests}")
        if rate is not None and rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        self.num_requests = num_requests
        self.rng = random.Random(seed)
        self.rate = rate
        self.issued = 0
        self.finished = 0
        self._ready: deque[Request] = deque()
        self._arrivals: list[tuple[float, int, Request]] = []

    @property
    def done(self) -> bool:
        """Nothing waiting, nothing running, nothing more to come."""
        return not self._ready and not self._arrivals and self.finished >= self.issued

    def take(self, now: float, limit: int) -> list[Request]:
        """Up to `limit` requests that have arrived by `now`, oldest first."""
        while self._arrivals and self._arrivals[0][0] <= now:
            self._ready.append(heapq.heappop(self._arrivals)[2])
        return [self._ready.popleft() for _ in range(min(limit, len(self._ready)))]

    def defer(self, requests: list[Request]) -> None:
        """Put requests back at the head of the queue, in order."""
        self._ready.extendleft(reversed(requests))

    def next_arrival(self) -> float | None:
        """When the next request arrives (None when none is scheduled)."""
        if self._ready:
            return 0.0
        return self._arrivals[0][0] if self._arrivals else None

    def finish(self, request: Request, now: float) -> None:
        self.finished += 1

    # -- helpers for subclasses ---------------------------------------------------------

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, VOCAB) for _ in range(n)]

    def _delay(self) -> float:
        return self.rng.expovariate(self.rate) if self.rate else 0.0

    def _arrive(self, at: float, client: int, tokens: list[int] | bytes, prompt_tokens: int) -> None:
        if not isinstance(tokens, bytes):
            tokens = pack(tokens)
        req = Request(self.issued, client, tokens, prompt_tokens)
        self.issued += 1
        heapq.heappush(self._arrivals, (at, req.rid, req))


class MultiTurn(Workload):
    """`clients` chats of up to `rounds` rounds (None: until `num_requests` were issued);
    each round appends a user turn to the conversation (prompt) and an answer (output);
    the next round arrives after the previous finished. A chat that would outgrow
    `max_context` tokens starts over with a new system prompt (a new conversation)."""

    def __init__(self, num_requests: int, seed: int = 0, *, clients: int = 8, rounds: int | None = None,
                 system_tokens: int = 48, turn_tokens: tuple[int, int] = (16, 96),
                 answer_tokens: tuple[int, int] = (16, 96), max_context: int = 2048,
                 rate: float | None = None):
        super().__init__(num_requests, seed, rate)
        if clients < 1:
            raise ValueError(f"clients must be >= 1, got {clients}")
        if system_tokens + turn_tokens[1] + answer_tokens[1] > max_context:
            raise ValueError(f"max_context {max_context} cannot hold one round "
                             f"({system_tokens} + {turn_tokens[1]} + {answer_tokens[1]} tokens)")
        self.rounds = rounds
        self.system_tokens = system_tokens
        self.max_context = max_context
        self._round = dict.fromkeys(range(clients), 0)
        self.turn_tokens = turn_tokens
        self.answer_tokens = answer_tokens
        self._history = {c: pack(self._tokens(system_tokens)) for c in range(clients)}
        for c in range(clients):
            self._next_turn(c, self._delay())

    def finish(self, request: Request, now: float) -> None:
        super().finish(request, now)
        self._history[request.client] = request.tokens
        self._next_turn(request.client, now + 1 + self._delay())

    def _next_turn(self, client: int, at: float) -> None:
        if self.issued >= self.num_requests or (self.rounds is not None and self._round[client] >= self.rounds):
            return
        self._round[client] += 1
        turn = self.rng.randint(*self.turn_tokens)
        answer_len = self.rng.randint(*self.answer_tokens)
        if len(self._history[client]) // 4 + turn + answer_len > self.max_context:
            self._history[client] = pack(self._tokens(self.system_tokens))
        prompt = self._history[client] + pack(self._tokens(turn))
        answer = pack(self._tokens(answer_len))
        self._arrive(at, client, prompt + answer, len(prompt) // 4)


class SharedPrefix(Workload):
    """Requests that each start with one of `groups` system prompts, followed by a
    unique question (prompt) and an answer (output)."""

    def __init__(self, num_requests: int, seed: int = 0, *, groups: int = 4, system_tokens: int = 256,
                 suffix_tokens: tuple[int, int] = (16, 128), answer_tokens: tuple[int, int] = (8, 64),
                 rate: float | None = None):
        super().__init__(num_requests, seed, rate)
        if groups < 1:
            raise ValueError(f"groups must be >= 1, got {groups}")
        systems = [self._tokens(system_tokens) for _ in range(groups)]
        at = 0.0
        for _ in range(num_requests):
            g = self.rng.randrange(groups)
            prompt = systems[g] + self._tokens(self.rng.randint(*suffix_tokens))
            answer = self._tokens(self.rng.randint(*answer_tokens))
            at += self._delay()
            self._arrive(at, g, prompt + answer, len(prompt))


WORKLOADS = {"multiturn": MultiTurn, "shared_prefix": SharedPrefix}
