"""Report: what a simulator run did and every defect it saw."""

from dataclasses import asdict, dataclass, field


@dataclass
class Report:
    """Counts of a run (tokens unless named otherwise). `ok` is False when any defect
    count (mismatches, accounting errors, invariant violations, stalls) is non-zero."""

    requests: int = 0
    prompt_tokens: int = 0
    device_tokens: int = 0    # prompt tokens found on the device
    host_tokens: int = 0      # prompt tokens loaded back from host
    computed_tokens: int = 0  # tokens the engine computed (prompt rest + output)
    inserted_tokens: int = 0
    cached_before_insert_tokens: int = 0
    load_backs: int = 0
    layer_event_waits: int = 0  # CUDA: per-layer IPC events the engine's stream waited on
    failed_loads: int = 0
    evict_calls: int = 0
    evicted_pages: int = 0
    deferred: int = 0         # requests sent back to the queue for lack of pages
    steps: int = 0
    byte_mismatches: int = 0
    chunk_mismatches: int = 0  # (page, buffer) chunks with at least one wrong byte
    protocol_errors: int = 0   # daemon answers that break the contract (counts, prefixes)
    accounting_errors: int = 0
    violations: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  # first few problems, for humans
    stalled: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.byte_mismatches or self.chunk_mismatches or self.protocol_errors
                    or self.accounting_errors or self.violations or self.stalled)

    def note(self, message: str, limit: int = 20) -> None:
        if len(self.messages) < limit:
            self.messages.append(message)

    def progress(self, total: int) -> str:
        return (f"[sim] {self.requests}/{total} requests, device {self.device_tokens} host {self.host_tokens} "
                f"computed {self.computed_tokens} tokens, {self.load_backs} load-backs, "
                f"{self.evicted_pages} pages evicted, {self.byte_mismatches} byte mismatches")

    def summary(self) -> list[str]:
        """Human-readable lines; the last is exactly "<N> byte mismatches"."""
        served = self.device_tokens + self.host_tokens
        rate = served / self.prompt_tokens if self.prompt_tokens else 0.0
        lines = [f"{k}: {v}" for k, v in asdict(self).items()
                 if k not in ("violations", "messages", "byte_mismatches")]
        lines.append(f"prefix hit rate: {rate:.3f} (device + host tokens / prompt tokens)")
        lines += [f"violation: {v}" for v in self.violations]
        lines += [f"problem: {m}" for m in self.messages]
        lines.append(f"{self.byte_mismatches} byte mismatches")
        return lines
