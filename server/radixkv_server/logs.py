"""Structured logs: one line per event, as key=value text or JSON.

    log_event(logger, "session.closed", session=sid, reason="ack stream ended")

prints `... level=info event=session.closed session=ab12 reason="ack stream ended"`.
Per-RPC events are logged at debug level only.
"""

import json
import logging
import sys
import time


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={"fields": fields})


def _quote(value) -> str:
    text = str(value)
    if not text or any(c in text for c in ' "=\n\t'):
        return json.dumps(text)
    return text


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        parts = [f"ts={ts}.{int(record.msecs):03d}Z", f"level={record.levelname.lower()}",
                 f"logger={record.name}", f"event={_quote(record.getMessage())}"]
        parts += [f"{k}={_quote(v)}" for k, v in getattr(record, "fields", {}).items()]
        if record.exc_info:
            parts.append(f"error={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": record.created, "level": record.levelname.lower(), "logger": record.name,
               "event": record.getMessage()}
        out.update({k: v if isinstance(v, (int, float, bool, type(None))) else str(v)
                    for k, v in getattr(record, "fields", {}).items()})
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out)


class CallerGone(logging.Filter):
    """gRPC logs at ERROR, with a traceback, every answer it could not send because the
    caller had gone: a health probe past its deadline while the daemon started, an engine
    that exited mid-call (its own handlers' such ends are `rpc.gone`, at debug). The
    caller's business, not a fault of the daemon's: kept at debug level."""

    PREFIX = "ExecuteBatchError raised in core by servicer method"

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(self.PREFIX):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # grpc's own debug chatter (one line per call) is not ours to print.
    logging.getLogger("grpc").setLevel(max(logging.WARNING, root.level))
    cygrpc = logging.getLogger("grpc._cython.cygrpc")
    if not any(isinstance(f, CallerGone) for f in cygrpc.filters):
        cygrpc.addFilter(CallerGone())
