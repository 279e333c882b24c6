"""The README's "Using it from an engine" snippet runs as written against a real daemon
(a smaller layout and pool, the test daemon's socket, and the engine's own allocator and
prompt supplied): once cold, then again as a restarted engine whose prefix sits on host."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
README_LAYOUT = 'KvLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)'
SMALL_LAYOUT = 'KvLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="bfloat16", page_size=16)'
README_TARGET = "unix:///run/radixkv/radixkv.sock"


def readme_snippet(target: str) -> str:
    [code] = re.findall(r"<!-- readme-engine -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert README_LAYOUT in code and README_TARGET in code and code.count("4096") == 2, "the snippet changed shape"
    return code.replace(README_LAYOUT, SMALL_LAYOUT).replace(README_TARGET, target).replace("4096", "64")


def engine_globals() -> dict:
    """What the snippet leaves to the engine: its prompt and its page allocator."""
    free = list(range(64))

    def my_free_pages(n: int) -> list[int]:
        taken, free[:] = free[:n], free[n:]
        return taken

    return {"prompt_tokens": list(range(1000, 1000 + 4 * 16 + 5)),  # 4 whole pages and a partial one
            "my_free_pages": my_free_pages, "my_free": lambda pages: free.extend(pages), "free": free}


def run_twice(code: str) -> tuple[dict, dict]:
    """The snippet as a cold engine, then as the engine restarted (its prefix on host)."""
    cold, warm = engine_globals(), engine_globals()
    exec(code, cold)  # noqa: S102 - the README's own code
    exec(code, warm)  # noqa: S102
    return cold, warm


def test_the_readme_engine_snippet_runs_cold_and_then_loads_back_its_prefix(daemon):
    cold, warm = run_twice(readme_snippet(daemon))
    assert cold["m"].device_tokens == cold["m"].host_tokens == 0
    assert cold["r"].cached_tokens == 0
    assert sorted(cold["free"]) == list(range(64))  # every page came back: write-through, evicted whole
    assert warm["m"].host_tokens == 4 * 16  # the restarted engine finds its prefix on host
    assert warm["lb"].loaded_tokens == 4 * 16
    assert warm["outcomes"] and all(o.ok for o in warm["outcomes"].values())
    assert warm["r"].cached_tokens == 4 * 16 and warm["new_pages"] == []
    assert sorted(warm["free"]) == list(range(64))


def test_after_a_failed_load_the_snippet_recomputes_and_loses_no_page(daemon_factory):
    d = daemon_factory("--fault-fail-loads", "1")  # every host -> device copy fails
    cold, warm = run_twice(readme_snippet(d.target))
    assert cold["m"].host_tokens == 0 and sorted(cold["free"]) == list(range(64))
    assert warm["m"].host_tokens == 4 * 16 and not any(o.ok for o in warm["outcomes"].values())
    assert warm["prefix"] == [] and len(warm["new_pages"]) == 4  # recomputed on fresh pages
    assert warm["r"].cached_tokens == 4 * 16  # the host copies stay; the engine's pages join them
    assert sorted(warm["free"]) == list(range(64))  # every page back once: none lost, none twice


def test_when_another_requests_load_of_the_prefix_fails_the_snippet_recomputes(daemon_factory):
    """Two requests of one step find the prefix on host and the other one's LoadBack runs
    first: the snippet's LoadBack answers transfer 0 and waits on the other's load
    (depends_on), which fails. The snippet recomputes, and every page comes back once
    (it indexed `outcomes[0]`, which `wait` never returns: a KeyError in the scheduler)."""
    d = daemon_factory("--fault-fail-loads", "1", "--fault-copy-delay", "0.3")
    code = readme_snippet(d.target)
    exec(code, engine_globals())  # noqa: S102 - a cold engine leaves the prefix on host
    g = engine_globals()
    allocate, other = g["my_free_pages"], {}

    def my_free_pages(n: int) -> list[int]:
        if not other:  # the snippet matched; the other request of its step loads first
            kv = g["kv"]
            [m] = kv.match([g["prompt_tokens"]], lease=True)
            other["lb"] = kv.load_back(m.host_node, allocate(m.host_tokens // 16))
            other["lease"] = m.lease
        return allocate(n)

    g["my_free_pages"] = my_free_pages
    exec(code.replace("kv.close(); buffers.close()", ""), g)  # noqa: S102
    assert g["lb"].transfer == 0 and list(g["lb"].depends_on) == [other["lb"].transfer]
    assert g["prefix"] == [] and len(g["new_pages"]) == 4  # recomputed on fresh pages
    outcome = g["kv"].wait([other["lb"].transfer])[other["lb"].transfer]
    assert not outcome.ok
    g["my_free"](outcome.failed_pages)  # the other request frees its own load's pages
    g["kv"].release([other["lease"]])
    g["my_free"](g["kv"].evict(256).freed_pages)
    assert sorted(g["free"]) == list(range(64))  # none lost, none twice
    g["kv"].close()
    g["buffers"].close()
