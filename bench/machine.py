"""What machine the figures came from, and placing this process's threads on its cores."""

import datetime
import importlib
import os
import platform
import sys


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> str:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def _version(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except Exception:
        return "absent"


def describe() -> list[tuple[str, str]]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    import torch
    return [
        ("date", datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")),
        ("CPU", _cpu_model()),
        ("cores", f"{os.cpu_count()} ({usable} usable), torch threads {torch.get_num_threads()}"),
        ("memory", _memory_gib()),
        ("OS", f"{platform.system()} {platform.release()}"),
        ("Python", sys.version.split()[0]),
        ("torch", _version("torch")),
        ("grpcio", _version("grpc")),
        ("gRPC I/O", _grpc_io()),
        ("protobuf", _version("google.protobuf")),
        ("numpy", _version("numpy")),
        ("uvloop", _version("uvloop")),
        ("redis-py", _version("redis")),
    ]


def _grpc_io() -> str:
    """The I/O layer of the bench's own process (engines, raw clients) and of the daemons it
    starts, which ask for the polling I/O unless GRPC_EXPERIMENTS is set (radixkv_server.grpc_io)."""
    from radixkv_server.grpc_io import POLLING_IO, polling_io_in_effect
    if "GRPC_EXPERIMENTS" not in os.environ:
        return f"bench process: EventEngine (default); daemons: polling ({POLLING_IO})"
    layer = "polling" if polling_io_in_effect() else "EventEngine"
    return f"bench process and daemons: {layer} (GRPC_EXPERIMENTS={os.environ['GRPC_EXPERIMENTS']!r})"


def pin_threads(cpus: set[int]) -> None:
    """Every thread of this process (threads started later inherit it) onto `cpus`."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):
            pass  # the thread ended meanwhile
