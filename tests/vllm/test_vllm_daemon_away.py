"""vLLM keeps serving when the radixkv daemon goes away, and the connector comes back
with the daemon: requests made while it is gone complete with the same output, and once
it is back the connector registers again and saves blocks again."""

from radixkv import Client
from tests.support.daemon import wait_for
from tests.vllm.engines import generate, prompt

RECONNECT_TIMEOUT_S = 90.0


def inserted_tokens(target: str) -> int:
    with Client(target, reconnect=None) as c:
        namespaces = c.stats("").namespaces
        return sum(ns.counters["inserted_tokens"] for ns in namespaces if ns.namespace == "tiny")


def test_requests_complete_while_the_daemon_is_killed_and_saves_resume_after(engines, daemon):
    prompts = [prompt(512, seed=s) for s in (20, 21)]
    plain = engines.start()
    base = [r for p in prompts for r in generate(plain, [p])]  # batched alike: one at a time
    engines.stop(plain)

    llm = engines.start(daemon.target)
    assert generate(llm, prompts[:1]) == base[:1]
    daemon.kill()
    [away] = generate(llm, prompts[1:])
    assert away.tokens == base[1].tokens
    assert away.logprobs == base[1].logprobs

    daemon.start()  # a new daemon on the same socket, empty
    seeds = iter(range(100, 10_000))

    def saved_again() -> bool:
        generate(llm, [prompt(300, seed=next(seeds))])  # each one fills two blocks
        return inserted_tokens(daemon.target) > 0

    wait_for(saved_again, RECONNECT_TIMEOUT_S, "the connector saving to the restarted daemon")
