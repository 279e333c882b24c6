"""The GPU check's preparation, checked where there is no GPU (docs/gpu.md).

A session lent a GPU has 15 minutes of device time; a check that stops at its import step
wastes a start. So, here: every third-party package the daemon, the client and the test
suite's conftest import is one that reaches the GPU machine (a wheel named by
scripts/gpu_packages.py, or the machine's own torch and numpy, or something those need);
and `scripts/gpu-check.sh quick` runs through on a machine without CUDA, finds every
package, imports the daemon, and says it FAILED for want of CUDA instead of passing.
"""

import ast
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_packages  # noqa: E402

# Where the imports are read: the daemon, the client library (less the vLLM connector's
# modules that import vLLM, which the GPU machine lacks: its GPU tests do not import them),
# and the test suite's shared fixtures.
SOURCES = ["server/radixkv_server", "client/radixkv", "tests/conftest.py", "tests/support", "tests/gpu"]
NOT_CARRIED = {"vllm"}  # only with vLLM installed, which no GPU machine here has


def module_level_imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports a module makes when it is imported (its
    body's own import statements; imports inside functions or try blocks are optional)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _closure(names: set[str]) -> set[str]:
    """`names` and everything they require (as installed here), canonical names."""
    seen, todo = set(), list(names)
    while todo:
        name = gpu_packages.canonical(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo.extend(re.match(r"[A-Za-z0-9._-]+", r).group(0) for r in requires if "extra ==" not in r)
    return seen


def test_every_package_the_daemon_imports_reaches_the_gpu_machine():
    files = [f for src in SOURCES for f in ((ROOT / src).rglob("*.py") if (ROOT / src).is_dir() else [ROOT / src])]
    imported: dict[str, set[str]] = {}
    for f in files:
        for name in module_level_imports(f):
            imported.setdefault(name, set()).add(str(f.relative_to(ROOT)))
    ours = {"radixkv", "radixkv_server", "tests", "ipc_engine"}
    third_party = {n for n in imported if n not in sys.stdlib_module_names and n not in ours}
    reaches = _closure(set(gpu_packages.minimums()) | gpu_packages.MACHINE_OWN | {"pytest"})  # pytest: on the machine
    by_module = metadata.packages_distributions()
    missing = {}
    for name in sorted(third_party - NOT_CARRIED):
        dists = {gpu_packages.canonical(d) for d in by_module.get(name, ())}
        if not dists & reaches:
            missing[name] = sorted(imported[name])[:3]
    assert not missing, (f"imported at module level but not carried to the GPU machine: {missing}; add the "
                         "package to a pyproject.toml's dependencies (scripts/gpu_packages.py reads both)")
    assert {"grpc", "msgspec", "zmq", "redis", "torch"} <= third_party  # the scan reads what it should


def test_where_the_daemon_and_its_client_both_name_a_package_the_daemons_higher_floor_is_carried():
    """The client's floors are lower (its generated code runs on older gRPC), but the
    daemon's gRPC is the one the GPU machine runs: with the client's read last, the check
    took a machine's protobuf 5 for enough, and the daemon failed its import there (the
    review of the split's diff)."""
    floors = gpu_packages.minimums()
    assert (floors["grpcio"], floors["protobuf"]) == ("1.85.1", "7.35.1")


def test_the_quick_pass_runs_through_without_cuda_and_does_not_pass(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PY": sys.executable}
    run = subprocess.run(["bash", "scripts/gpu-check.sh", "quick"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    out = run.stdout + run.stderr
    for name in gpu_packages.minimums():
        assert re.search(rf"^  {re.escape(name)}: \S+ \(need >= [^)]+\): ok$", out, re.M), (name, out[-3000:])
    assert "imports ok" in out, out[-3000:]
    assert re.search(r"\d+ skipped", out), out[-3000:]  # the tests ran, and skipped for want of CUDA
    assert run.returncode == 1 and out.rstrip().endswith("GPU CHECK (quick) FAILED: no CUDA"), out[-3000:]
    assert (tmp_path / "gpu-check.log").read_text().rstrip().endswith("FAILED: no CUDA")
