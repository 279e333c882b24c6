"""docs/examples/router.py --demo routes each prompt to the daemon that holds it: GPU,
CPU-only and storage-only holders alike."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_router_example_demo_picks_each_holder():
    out = subprocess.run([sys.executable, str(ROOT / "docs/examples/router.py"), "--demo"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    lines = out.strip().splitlines()
    assert lines[0].startswith("prompt A -> w0 (gpu 8")
    assert lines[1].startswith("prompt B -> w1 (gpu 0, cpu 8")
    assert lines[2].startswith("prompt C -> w2 (gpu 0, cpu 0, storage 8")
