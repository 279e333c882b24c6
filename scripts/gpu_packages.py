"""The Python packages the GPU check needs beyond the GPU machine's own torch and numpy,
read from the dependencies of both pyproject.toml files (the daemon's and its client's,
the higher floor where both name a package), so that a dependency added there travels to the
GPU machine without anyone remembering this list (a missing one stopped the first run on
an H200 at its import check).

    python3 scripts/gpu_packages.py --minimums   # name>=minimum, one a line (gpu-check.sh)
    python3 scripts/gpu_packages.py --pins       # name==version installed here (fetch-gpu-wheels.sh)

Also importable: `minimums()` -> {name: minimum version}.
"""

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
# The GPU machine brings its own CUDA builds of these: never replaced by a wheel from here.
MACHINE_OWN = {"torch", "numpy"}
# What a dependency itself needs and a GPU machine may have too old: grpcio imports
# typing_extensions' newer names.
INDIRECT = {"typing-extensions": "4.12"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def minimums() -> dict[str, str]:
    """{canonical name: minimum version ("0" when none is given)} of the project's
    dependencies (the daemon's and its client's, with the extras the daemon needs), less
    the machine's own and the client itself (a package of this tree), plus INDIRECT."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    with open(ROOT / "client" / "pyproject.toml", "rb") as f:
        client = tomllib.load(f)["project"]
    deps += client["dependencies"] + client["optional-dependencies"]["buffers"] + \
        client["optional-dependencies"]["routing"]
    out = {}
    for dep in deps:
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^]]*\])?\s*(.*)", dep)
        name, spec = canonical(m.group(1)), m.group(2).split(";")[0]
        if name in MACHINE_OWN or name == "radixkv":
            continue
        low = re.search(r">=\s*([0-9][^,\s]*)", spec)
        floor = low.group(1) if low else "0"
        if name not in out or Version(floor) > Version(out[name]):  # the daemon's floor and the client's: the higher
            out[name] = floor
    return {**out, **INDIRECT}


def main(argv: list[str]) -> int:
    if argv == ["--minimums"]:
        print("\n".join(f"{n}>={v}" for n, v in minimums().items()))
    elif argv == ["--pins"]:
        print("\n".join(f"{n}=={metadata.version(n)}" for n in minimums()))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
