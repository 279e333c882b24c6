"""`radixkv-server` / `python -m radixkv_server`: parse the config, log it, serve."""

import logging
import sys

from .grpc_io import polling_io_in_effect, prefer_polling_io

prefer_polling_io()  # before the imports below bring gRPC in (grpc_io says why)

import torch
import uvloop

from .config import load_config, unknown_variables
from .logs import log_event, setup_logging
from .malloc import keep_freed_heap
from .server import StartupError, serve

log = logging.getLogger("radixkv")


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ValueError as e:
        print(f"radixkv-server: {e}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_format)
    # Copy threads supply the parallelism; torch's intra-op threads on top of them
    # oversubscribe the cores and make scattered page copies collapse.
    torch.set_num_threads(1)
    if not keep_freed_heap(config.malloc_trim_threshold):
        log_event(log, "malloc.untuned", logging.WARNING, reason="the C library is not glibc or refused mallopt",
                  note="storage fetches fault in fresh memory for every batch")
    settings = {k: (",".join(v) if isinstance(v, tuple) else v) for k, v in config.describe().items()}
    log_event(log, "config", grpc_io="polling" if polling_io_in_effect() else "event_engine", **settings)
    unknown = unknown_variables()
    if unknown:
        log_event(log, "config.unknown_variables", logging.WARNING, names=",".join(unknown),
                  note="no radixkv-server setting has these names: ignored (radixkv-server --help lists them)")
    try:
        return uvloop.run(serve(config))
    except StartupError as e:
        log_event(log, "daemon.failed", logging.ERROR, reason=str(e))
        return 1


if __name__ == "__main__":
    sys.exit(main())
