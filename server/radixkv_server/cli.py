"""`radixkv-server` / `python -m radixkv_server`: parse the config, log it, serve."""

import faulthandler
import logging
import signal
import sys

# Run as the daemon: a stop asked for while the heavy imports below run (torch's takes a
# second) is noted, and honoured once the daemon can stop cleanly (Python's default raised
# KeyboardInterrupt inside an import, a traceback, or the import swallowed it and the
# daemon served on). Imported by another program, its signals are left alone.
_STOPPED_EARLY: list[int] = []
if sys.argv and sys.argv[0].endswith(("radixkv-server", "radixkv_server/__main__.py")):
    for _sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(_sig, lambda signum, frame: _STOPPED_EARLY.append(signum))

from .grpc_io import polling_io_in_effect, prefer_polling_io  # noqa: E402

prefer_polling_io()  # before the imports below bring gRPC in (grpc_io says why)

import torch  # noqa: E402
import uvloop  # noqa: E402

from .config import load_config, unknown_variables  # noqa: E402
from .logs import log_event, setup_logging  # noqa: E402
from .malloc import keep_freed_heap  # noqa: E402
from .server import BadSetting, StartupError, serve  # noqa: E402

log = logging.getLogger("radixkv")


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ValueError as e:
        print(f"radixkv-server: {e}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_format)
    # SIGUSR1 writes every thread's Python stack to stderr (the log), from the signal
    # handler, so it works while the event loop is stuck, holding the GIL or not: the
    # RadixKVLoopStuck runbook's first step, with nothing to install in the image.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
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
        return uvloop.run(serve(config, stopped_early=lambda: bool(_STOPPED_EARLY)))
    except StartupError as e:
        log_event(log, "daemon.failed", logging.ERROR, reason=str(e))
        return 2 if isinstance(e, BadSetting) else 1
    finally:  # stopped: a second signal while the interpreter winds down changes nothing
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
