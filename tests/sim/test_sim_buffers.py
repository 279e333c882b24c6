"""The simulator's device buffers and its CUDA-only paths, on a machine without CUDA."""

import pytest
import torch

from radixkv.layout import KvLayout
from radixkv.sim import KvPattern, SimBuffers
from radixkv.sim.cli import main, parse_args
from radixkv.sim.engine import Engine
from radixkv.types import LoadBackResult

LAYOUT = KvLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", page_size=2)


def test_shm_buffers_match_their_specs_and_close_twice():
    bufs = SimBuffers.create(LAYOUT, 4)
    try:
        assert bufs.backend == "shm" and bufs.stream is None and len(bufs.tensors) == LAYOUT.num_buffers
        assert [s.size for s in bufs.specs] == [LAYOUT.buffer_bytes(4)] * LAYOUT.num_buffers
        bufs.tensors[1].fill_(1)
        assert int(bufs.tensors[0].abs().sum()) == 0  # buffers do not overlap
    finally:
        bufs.close()
        bufs.close()
    assert bufs.tensors == []


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend 'tpu'"):
        SimBuffers.create(LAYOUT, 4, "tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_cuda_backend_without_a_gpu_exits_2(capsys):
    with pytest.raises(ValueError, match="needs torch with CUDA"):
        SimBuffers.create(LAYOUT, 4, "cuda", 0)
    assert main(["--backend", "cuda", "--target", "unix:///nonexistent/radixkv.sock"]) == 2
    assert "needs torch with CUDA" in capsys.readouterr().err


def test_cli_flags_reach_the_config():
    c = parse_args(["--backend", "cuda", "--device", "3"])
    assert (c.backend, c.device) == ("cuda", 3)
    assert parse_args([]).backend == "shm"


def test_pattern_refuses_buffers_on_two_devices():
    bufs = [torch.zeros(8, 1, 8, dtype=torch.float16), torch.zeros(8, 1, 8, dtype=torch.float16, device="meta")]
    with pytest.raises(ValueError, match="one device"):
        KvPattern(KvLayout(1, 1, 8, "float16", 2), bufs, 4)


def test_events_sent_to_an_engine_without_cuda_are_a_protocol_error():
    bufs = SimBuffers.create(LAYOUT, 4)
    try:
        eng = Engine(None, LAYOUT, bufs.tensors, 4)
        assert eng.stream is None
        lb = LoadBackResult(1, b"", 0, 0, (), b"", (b"e0", b"e1"))
        eng._wait_layers(lb)
        assert eng.report.protocol_errors == 1 and eng.report.layer_event_waits == 0
        eng._wait_layers(LoadBackResult(2, b"", 0, 0, (), b"", ()))
        assert eng.report.protocol_errors == 1
    finally:
        bufs.close()


@pytest.mark.parametrize("flag, value, says", [
    ("--torch-threads", "-1", "must be 0 or more"),
    ("--batch", "0", "must be at least 1"),
    ("--device-pages", "0", "must be at least 1"),
    ("--requests", "-5", "must be at least 1"),
])
def test_a_count_out_of_range_is_refused_before_anything_starts(capsys, flag, value, says):
    """Exit 2 with argparse's line naming the flag, before any daemon is contacted
    (a negative thread count ended in a traceback; a batch of 0 was refused after
    registering)."""
    with pytest.raises(SystemExit) as exit_:
        parse_args([flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and says in err
