"""The fuzzing campaign: every RPC and stream of a real daemon fed generated messages and
byte-level mutations of valid ones, while a valid engine verifies its bytes.

- A daemon (file storage, WatchEvents on, small limits, lease and ack timeouts) serves
  three fuzz sessions (namespaces fuzz/0-2, each with a few prefixes on device and host,
  no ack stream) and one valid engine (the engine double, namespace `valid/engine`,
  which the fuzzer never names).
- The fuzzer draws, per message, a method of the RadixKV and health services and either
  a message generated from its request descriptor (`protostrategies.messages`, with
  hints: live fuzz session ids, packed page lists, small node and transfer ids) or a
  byte-level mutation of one (`protostrategies.mutated`), and sends the raw bytes;
  request streams get one to three messages. It never names the valid engine's session.
- The valid engine loops in a thread: match, load host hits back, verify every byte of
  the device prefix against its pattern, prefill what is missing, evict now and then.
- Every few seconds, and at the end: CheckInvariants over every namespace.

It passes when no answer is INTERNAL or UNKNOWN, the daemon logs no traceback and no
error line, the valid engine saw 0 byte mismatches (and no error), and every
CheckInvariants was clean. `run(seconds)` returns the figures (messages tried per
method and kind, codes returned).
"""

import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2  # noqa: F401  (registers the health descriptors)
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from radixkv.client import Client
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.types import pack
from radixkv.v1 import radixkv_pb2 as pb
from tests.support.daemon import DaemonProcess
from tests.support.engine import LAYOUT, EngineDouble, prompt

from .protostrategies import messages, mutated

SERVICES = ("radixkv.v1.RadixKV", "grpc.health.v1.Health")
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
NUM_PAGES = 64
FUZZ_NAMESPACES = ("fuzz/0", "fuzz/1", "fuzz/2")
VALID_NAMESPACE = "valid/engine"
CHECK_EVERY_S = 5.0
BATCH = 10  # examples per hypothesis run; runs repeat until the time is up


def daemon_flags(storage_dir: str) -> tuple[str, ...]:
    return ("--storage", f"file://{storage_dir}", "--kv-events-watch", "true", "--host-pool-size", "1MiB",
            "--max-host-pool-size", "2MiB", "--max-namespaces", "16", "--max-sessions", "32",
            "--max-message-size", "1MiB", "--max-prompts-per-match", "64", "--lease-timeout", "10",
            "--ack-timeout", "10", "--write-policy", "write_back")


def methods():
    pool = descriptor_pool.Default()
    return [m for s in SERVICES for m in pool.FindServiceByName(s).methods]


@dataclass
class Figures:
    seconds: float = 0.0
    tried: Counter = field(default_factory=Counter)   # (method, kind) -> messages sent
    codes: Counter = field(default_factory=Counter)   # status code name -> answers
    forbidden: list = field(default_factory=list)     # (method, code, message, raw) answered INTERNAL/UNKNOWN
    invariant_checks: int = 0
    violations: list = field(default_factory=list)
    pages_verified: int = 0
    mismatches: int = 0
    engine_errors: list = field(default_factory=list)
    log_problems: list = field(default_factory=list)

    @property
    def messages(self) -> int:
        return sum(self.tried.values())

    @property
    def clean(self) -> bool:
        return not (self.forbidden or self.violations or self.mismatches or self.engine_errors or self.log_problems)


class FuzzSession:
    """A session of a fuzz namespace on raw messages (no ack stream), re-registered when
    the fuzzer closed it."""

    def __init__(self, stub, namespace: str):
        self.stub, self.namespace = stub, namespace
        self.buffers = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
        self.id = ""

    def register_request(self, replace: bool = True) -> pb.RegisterRequest:
        layout = pb.KvLayout(num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads,
                             head_dim=LAYOUT.head_dim, dtype=LAYOUT.dtype, page_size=LAYOUT.page_size)
        return pb.RegisterRequest(
            namespace=self.namespace, layout=layout, backend="shm", num_device_pages=NUM_PAGES,
            buffers=[pb.DeviceBuffer(handle=bytes(s[0]), offset=s[1], size=s[2]) for s in self.buffers.specs()],
            host_pool_pages=128, replace_existing=replace, engine="fuzz")

    def ensure(self) -> None:
        """Register again (with a few prefixes, some on host only) if the session is gone."""
        try:
            if self.id:
                self.stub.Match(pb.MatchRequest(session=self.id), timeout=5)
                return
        except grpc.RpcError:
            pass
        self.id = self.stub.Register(self.register_request(), timeout=10).session
        for i in range(3):
            tokens = pack(range(100 * i, 100 * i + 4 * LAYOUT.page_size))
            try:
                self.stub.Insert(pb.InsertRequest(session=self.id, tokens=tokens,
                                                  device_pages=pack(range(4 * i, 4 * i + 4))), timeout=5)
            except grpc.RpcError:
                pass  # fuzzed state got in the way: fine
        self.stub.Evict(pb.EvictRequest(session=self.id, num_pages=4), timeout=10)

    def close(self) -> None:
        self.buffers.close()


class ValidEngine(threading.Thread):
    """The valid workload: the engine double looping over a few prompts, verifying bytes."""

    def __init__(self, target: str, figures: Figures, seed: int):
        super().__init__(name="valid-engine", daemon=True)
        self.engine = EngineDouble.connect(target, VALID_NAMESPACE, num_pages=128, write_policy="write_back",
                                           host_pool_pages=256)
        self.figures, self.rng, self.stop = figures, random.Random(seed), threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                tokens = prompt(self.rng.randrange(12), pages=self.rng.randrange(1, 6))
                n, (byte_mismatches, _) = self.engine.load(tokens)
                self.figures.pages_verified += n // LAYOUT.page_size
                self.figures.mismatches += byte_mismatches
                if n < len(tokens):
                    self.engine.prefill(tokens)
                if self.rng.random() < 0.3:
                    self.engine.evict(self.rng.randrange(1, 24))
        except Exception as e:  # any failure of a valid engine is a finding
            self.figures.engine_errors.append(repr(e))
        if self.engine.pool.errors:
            self.figures.engine_errors.extend(self.engine.pool.messages)


class Campaign:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self.storage = tempfile.mkdtemp(prefix="rkv-fuzz-store-")
        self.daemon = DaemonProcess(*daemon_flags(self.storage))
        self.figures = Figures()
        self.methods = methods()

    def run(self, seconds: float) -> Figures:
        self.daemon.start()
        channel = grpc.insecure_channel(self.daemon.target)
        stub = pb_stub(channel)
        sessions = [FuzzSession(stub, ns) for ns in FUZZ_NAMESPACES]
        engine = ValidEngine(self.daemon.target, self.figures, self.seed)
        try:
            for s in sessions:
                s.ensure()
            engine.start()
            self._fuzz(channel, stub, sessions, seconds)
        finally:
            engine.stop.set()
            engine.join(60)
            self._check(stub)
            engine.engine.close()
            for s in sessions:
                s.close()
            channel.close()
            code = self.daemon.stop()
            log = self.daemon.log()
            self.figures.log_problems = [line for line in log.splitlines()
                                         if "level=error" in line or "Traceback" in line][:20]
            if code != 0:
                self.figures.log_problems.append(f"daemon exited with {code} on SIGTERM")
            self.daemon.cleanup()
            shutil.rmtree(self.storage, ignore_errors=True)
        return self.figures

    def _fuzz(self, channel, stub, sessions, seconds: float) -> None:
        start = time.monotonic()
        end, next_check = start + seconds, start + CHECK_EVERY_S
        example, seeds = self._example(channel, sessions), random.Random(self.seed)
        while time.monotonic() < end:
            for s in sessions:
                s.ensure()  # between batches: the fuzzer may have closed one
            # Each batch its own seed, drawn from the campaign's: reproducible, and not the
            # same ten examples every batch (derandomize, which CI=true turns on, would be).
            seed(seeds.getrandbits(64))(example)()
            if time.monotonic() >= next_check:
                self._check(stub)
                next_check = time.monotonic() + CHECK_EVERY_S
        self.figures.seconds = time.monotonic() - start

    def _example(self, channel, sessions):
        """A hypothesis test of BATCH examples: one message (or stream) each."""
        hints = self._hints(sessions)
        strategies = {m.full_name: messages(m.input_type, hints) for m in self.methods}

        @settings(max_examples=BATCH, deadline=None, database=None, phases=[Phase.generate], derandomize=False,
                  suppress_health_check=list(HealthCheck))
        @given(st.data())
        def example(data):
            method = data.draw(st.sampled_from(self.methods), label="method")
            kind = data.draw(st.sampled_from(["generated", "mutated"]), label="kind")
            count = data.draw(st.integers(1, 3), label="stream messages") if method.client_streaming else 1
            raws = []
            for _ in range(count):
                raw = data.draw(strategies[method.full_name], label="message").SerializeToString()
                raws.append(data.draw(mutated(raw), label="mutated") if kind == "mutated" else raw)
            self.figures.tried[(method.name, kind)] += 1
            code, message = call(channel, method, raws)
            self.figures.codes[code.name] += 1
            if code in FORBIDDEN:
                self.figures.forbidden.append((method.name, code.name, message, raws))
        return example

    def _hints(self, sessions) -> dict:
        ints = st.integers(0, 40)
        pages = st.lists(st.integers(-2, NUM_PAGES + 2), max_size=24).map(pack)
        return {
            "session": st.integers(0, 99).map(lambda i: sessions[i % len(sessions)].id),
            "namespace": st.sampled_from(FUZZ_NAMESPACES),
            "tokens": st.lists(st.integers(0, 300), max_size=32).map(pack), "device_pages": pages,
            "extra_key": st.sampled_from([b"", b"lora-1"]),
            "node": ints, "transfer": ints, "lease": {"bool": st.booleans(), "int": ints}, "leases": ints,
            "release_lease": ints,
            "num_pages": ints, "num_device_pages": st.integers(1, NUM_PAGES), "from_seq": ints,
            "max_nodes": ints, "backend": st.sampled_from(["shm", "cuda"]),
            "layout": st.just(sessions[0].register_request().layout),
            "buffers": st.sampled_from(list(sessions[0].register_request().buffers)),
            "write_policy": st.sampled_from(["", "write_back", "write_through", "write_through_selective"]),
            "policy": st.sampled_from(["", "best_effort", "wait_complete", "timeout"]),
            "timeout_ms": st.integers(0, 200), "host_pool_pages": st.integers(0, 300),
        }

    def _check(self, stub) -> None:
        try:
            reply = stub.CheckInvariants(pb.CheckInvariantsRequest(), timeout=30)
        except grpc.RpcError as e:
            self.figures.violations.append(f"CheckInvariants failed: {e.code().name}: {e.details()}")
            return
        self.figures.invariant_checks += 1
        self.figures.violations += [f"{v.namespace}: {v.message}" for v in reply.violations]


def pb_stub(channel):
    from radixkv.v1 import radixkv_pb2_grpc
    return radixkv_pb2_grpc.RadixKVStub(channel)


def call(channel, method, raws: list[bytes]) -> tuple[grpc.StatusCode, str]:
    """Send raw request bytes to `method`; (code, message) of its end. Server streams are
    read for at most 0.3 s (WatchEvents and health Watch run until cancelled)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    try:
        if method.client_streaming:
            responses = channel.stream_stream(path)(iter(raws), timeout=2)
            for _ in responses:
                pass
        elif method.server_streaming:
            for _ in channel.unary_stream(path)(raws[0], timeout=0.3):
                pass
        else:
            channel.unary_unary(path)(raws[0], timeout=10)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def report(f: Figures) -> str:
    lines = [f"fuzzed {f.seconds:.0f} s: {f.messages} messages ({'clean' if f.clean else 'NOT CLEAN'})",
             "codes: " + ", ".join(f"{k} {v}" for k, v in f.codes.most_common()),
             f"valid engine: {f.pages_verified} prefix pages verified, {f.mismatches} byte mismatches, "
             f"{len(f.engine_errors)} errors",
             f"CheckInvariants: {f.invariant_checks} runs, {len(f.violations)} violations"]
    per_method, per_kind = Counter(), Counter()
    for (name, kind), n in f.tried.items():
        per_method[name] += n
        per_kind[kind] += n
    lines.append("per kind: " + ", ".join(f"{k} {v}" for k, v in sorted(per_kind.items())))
    lines.append("per method: " + ", ".join(f"{k} {v}" for k, v in sorted(per_method.items())))
    for method, code, message, raws in f.forbidden[:5]:
        lines.append(f"FORBIDDEN {method}: {code}: {message} ({[r.hex() for r in raws]})")
    lines += [f"VIOLATION {v}" for v in f.violations[:5]]
    lines += [f"ENGINE {e}" for e in f.engine_errors[:5]]
    # The first in full (a traceback is one escaped line): enough to find the bug by.
    lines += [f"LOG {line[:4000 if i == 0 else 300]}" for i, line in enumerate(f.log_problems[:5])]
    return "\n".join(lines)
