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
from collections.abc import Callable

from . import reasons
from .errors import exhausted

MACHINE_SHARE = 0.8  # of the machine's memory, outside a memory-limited cgroup
DAEMON_OWN = 1 << 30  # kept from a cgroup's limit for the daemon itself (Python, gRPC, buffers)

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
_LIMIT_FILES = ("memory.max", "memory.limit_in_bytes")  # cgroup v2, v1


def machine_memory() -> int:
    """The machine's memory in bytes (MemTotal)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cgroup_limit(proc_cgroup: str = PROC_CGROUP, root: str = CGROUP_ROOT) -> int | None:
    """The tightest memory limit on this process: its own memory cgroup's and every
    ancestor's (a systemd unit's `MemoryMax=` sits below the mount's root, a slice's
    limit above the unit), in bytes; None when none is set (or each is above the
    machine's memory, as cgroup v1 says "none"). Read from the cgroup `proc_cgroup`
    names, under `root`, walking up to `root` itself: in a container the mount's root is
    the container's own cgroup, whatever path /proc names."""
    machine = machine_memory()
    limits = []
    for directory in _memory_cgroup_dirs(proc_cgroup, root):
        for name in _LIMIT_FILES:
            try:
                with open(os.path.join(directory, name)) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < machine:
                limits.append(int(text))
    return min(limits, default=None)


def _memory_cgroup_dirs(proc_cgroup: str, root: str) -> list[str]:
    """The directories of this process's memory cgroup and its ancestors, deepest first:
    cgroup v1's memory hierarchy where it is mounted, else the v2 hierarchy (at `root`,
    or `root`/unified on a hybrid system)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    v1 = v2 = None
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if "memory" in controllers.split(","):
            v1 = path
        elif controllers == "":
            v2 = path
    mount = os.path.join(root, "memory")
    if v1 is not None and os.path.isdir(mount):
        base, path = mount, v1
    else:
        unified = os.path.join(root, "unified")
        base = unified if os.path.isfile(os.path.join(unified, "cgroup.controllers")) else root
        path = v2 or "/"
    parts = [p for p in path.split("/") if p and p != ".."]
    return [os.path.join(base, *parts[:n]) for n in range(len(parts), -1, -1)]


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


def check_room(held: dict[str, int], name: str, nbytes: int, limit: int, source: str,
               sees: Callable[[str], bool] | None = None) -> None:
    """Raise RESOURCE_EXHAUSTED (saying what holds the memory) when a new host pool of
    `nbytes` for namespace `name` would take the pools in `held` (name -> bytes) past `limit`.
    Only pools of namespaces `sees` allows are named (None: every one), the others summed:
    a tenant's refusal must not name another tenant's namespaces."""
    total = sum(held.values()) + nbytes
    if total > limit:
        named = {n: b for n, b in held.items() if sees is None or sees(n)}
        holders = ", ".join(f"{n}: {b}" for n, b in sorted(named.items(), key=lambda kv: -kv[1])[:8])
        if len(named) < len(held):
            others = sum(b for n, b in held.items() if n not in named)
            holders = f"{holders}, " * bool(holders) + f"other namespaces ({len(held) - len(named)}): {others}"
        holders = holders or "none"
        raise exhausted(
            f"a host pool of {nbytes} bytes for namespace {name} would take the host pools to {total} bytes, "
            f"past {limit} ({source}); pools held: {holders}. Register with fewer host_pool_pages, drop a "
            "namespace (DropNamespace) or raise --max-host-memory", reasons.HOST_MEMORY_BUDGET)
