"""The benchmarks still run: each section in its tiny mode (seconds), in a subprocess,
writing into a temporary directory. Checks the output format and the generated report,
never a timing."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from bench.figures import Figure, fmt, parse_line  # bench/ is importable: pytest pythonpath "."

REPO = Path(__file__).resolve().parents[1]
SECTIONS = {  # section -> a figure every tiny run must print
    "core": "core.match_d2@",
    "rpc": "rpc.unix.match.p50",
    "copy": "copy.load_scattered.64KiB",
    "workload": "workload.byte_mismatches",
    "storage": "storage.file.prefetch",
    "events": "events.match.p50",
    "node": "node.match.p99@",
    "routing": "routing.query.p50@",
    "vllm": "vllm.ttft.radixkv_host_hit",  # real vLLM engines: about 90 s in tiny mode
}
TITLES = {"core": "## Core", "rpc": "## RPC", "copy": "## Copy", "workload": "## Workload", "storage": "## Storage",
          "events": "## KV events", "node": "## Node load", "routing": "## Routing",
          "vllm": "## vLLM"}


def test_figure_line_round_trips():
    f = Figure("rpc.unix.match.p50", 412.345, "us", "echo", 330.0)
    parsed = parse_line(f.line())
    assert parsed == {"name": "rpc.unix.match.p50", "value": 412.0, "unit": "us", "baseline": "echo",
                      "base": 330.0, "ratio": 1.25}
    assert parse_line("[bench 1.0s] progress") is None
    assert fmt(0.000123456) == "0.000123" and fmt(123456.7) == "123457" and fmt(0) == "0"


@pytest.mark.parametrize("section", list(SECTIONS))
def test_section_runs_and_reports(section, tmp_path):
    if section == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed: `make vllm-install`")
    plots = importlib.util.find_spec("matplotlib") is not None
    cmd = [sys.executable, "-m", "bench", "--tiny", "--only", section, "--out", str(tmp_path), "--no-profile"]
    if not plots:
        cmd.append("--no-plots")
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"bench {section} failed:\n{run.stderr[-4000:]}"
    lines = run.stdout.splitlines()
    assert lines, f"bench {section} printed no figure:\n{run.stderr[-2000:]}"
    parsed = [parse_line(line) for line in lines]
    assert all(parsed), f"lines that are not figures: {[l for l, p in zip(lines, parsed) if not p]}"
    names = [p["name"] for p in parsed]
    assert all(n.startswith(section + ".") for n in names), names
    assert any(n.startswith(SECTIONS[section]) for n in names), names
    for p in parsed:
        assert p["base"] > 0 or p["unit"] in ("%", "bytes"), p
    md = (tmp_path / "benchmarks.md").read_text()
    assert TITLES[section] in md and "## Machine" in md and "tiny mode" in md
    for line in lines:
        assert line in md  # the printed figures are in the report verbatim
    if plots and section in ("core", "copy", "workload"):
        assert list((tmp_path / "img").glob("*.png")), "no plot written"
