"""The daemon-wide host memory budget: all namespaces' host pools together stay under
--max-host-memory. By default: in a container (a cgroup memory limit), that limit less
1 GiB for the daemon's own memory; elsewhere 80% of the machine's memory, leaving the rest
to the engines. A Register that would create a namespace past it is refused with
RESOURCE_EXHAUSTED before any memory is taken: a daemon that overcommits is killed by the
kernel once its pools fill (pinned pools are committed at once), and every engine on the
node loses its cache with it. Re-attaching an existing namespace takes no new memory and
is never refused here.
"""

import os

from .errors import exhausted

MACHINE_SHARE = 0.8  # of the machine's memory, outside a memory-limited cgroup
DAEMON_OWN = 1 << 30  # kept from a cgroup's limit for the daemon itself (Python, gRPC, buffers)

_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max",                    # cgroup v2
                  "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # cgroup v1


def machine_memory() -> int:
    """The machine's memory in bytes (MemTotal)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cgroup_limit() -> int | None:
    """This process's cgroup memory limit in bytes, or None when it has none (or it is
    above the machine's memory, as cgroup v1 says "none")."""
    machine = machine_memory()
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < machine:
            return int(text)
    return None


def host_memory_limit(max_host_memory: int) -> tuple[int, str]:
    """(bytes all host pools may take, where that figure comes from, for messages)."""
    if max_host_memory:
        return max_host_memory, "--max-host-memory"
    limit = cgroup_limit()
    if limit is not None:
        return max(0, limit - DAEMON_OWN), f"the cgroup's memory limit of {limit} bytes less 1 GiB; " \
                                           "set --max-host-memory"
    machine = machine_memory()
    return int(machine * MACHINE_SHARE), f"{MACHINE_SHARE:.0%} of the machine's {machine} bytes; " \
                                         "set --max-host-memory"


def check_room(held: dict[str, int], name: str, nbytes: int, limit: int, source: str) -> None:
    """Raise RESOURCE_EXHAUSTED (saying what holds the memory) when a new host pool of
    `nbytes` for namespace `name` would take the pools in `held` (name -> bytes) past `limit`."""
    total = sum(held.values()) + nbytes
    if total > limit:
        holders = ", ".join(f"{n}: {b}" for n, b in sorted(held.items(), key=lambda kv: -kv[1])[:8]) or "none"
        raise exhausted(
            f"a host pool of {nbytes} bytes for namespace {name} would take the host pools to {total} bytes, "
            f"past {limit} ({source}); pools held: {holders}. Register with fewer host_pool_pages, drop a "
            "namespace (DropNamespace) or raise --max-host-memory")
