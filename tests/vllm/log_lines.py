"""What the connector logs, for tests: vLLM's loggers do not propagate to pytest's caplog,
and vLLM's logging setup at engine start clears the handlers of its children, so a test
of a running engine enters `LogLines` after the engine started."""

import logging


class LogLines(logging.Handler):
    """Within `with LogLines(level) as lines:`, the records of logger `name` (the
    connector's, "vllm.radixkv", unless given) at `level` and above, as (level, message);
    the logger is opened down to `level` for the block if it was not already (as vLLM's
    logging setup opens it to INFO)."""

    def __init__(self, level: int = logging.DEBUG, name: str = "vllm.radixkv"):
        super().__init__(level)
        self.records: list[tuple[int, str]] = []
        self._logger = logging.getLogger(name)
        self._was = self._logger.level

    def emit(self, record) -> None:
        self.records.append((record.levelno, record.getMessage()))

    def __enter__(self) -> "LogLines":
        self._was = self._logger.level
        self._logger.addHandler(self)
        if self._logger.getEffectiveLevel() > self.level:
            self._logger.setLevel(self.level)
        return self

    def __exit__(self, *exc) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._was)

    def messages(self, level: int = logging.WARNING) -> list[str]:
        return [message for at, message in self.records if at >= level]
