"""Generate the Python gRPC code for proto/ into client/radixkv/ (committed), and each
file's descriptor with its comments (`<name>_source.binpb`, a FileDescriptorSet): the
daemon's reflection answers with it, so `grpcurl describe` shows the contract's comments.

`--check` regenerates into a temporary directory and fails if the committed files
differ, so CI catches a .proto edit without regenerated code.
"""

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted((ROOT / "proto").rglob("*.proto"))
OUT = ROOT / "client"


def generate(out: Path) -> None:
    include = Path(protoc.__file__).parent / "_proto"
    for proto in PROTOS:
        source = out / proto.relative_to(ROOT / "proto").with_name(f"{proto.stem}_source.binpb")
        args = [
            "protoc", f"-I{ROOT / 'proto'}", f"-I{include}",
            f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}",
            f"--descriptor_set_out={source}", "--include_source_info",
            str(proto),
        ]
        if protoc.main(args) != 0:
            sys.exit(f"protoc failed on {proto}")


def generated_files(base: Path) -> list[Path]:
    return sorted(p.relative_to(base) for pattern in ("*_pb2*.py*", "*_source.binpb") for p in base.rglob(pattern))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed code is stale")
    args = parser.parse_args()
    if not args.check:
        generate(OUT)
        print(f"generated {', '.join(map(str, generated_files(OUT)))}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = generated_files(Path(tmp))
        stale = [f for f in fresh if not (OUT / f).exists() or not filecmp.cmp(Path(tmp) / f, OUT / f, shallow=False)]
        if stale:
            sys.exit(f"generated code is stale: {', '.join(map(str, stale))}; run `make proto` and commit")
    print(f"generated code is current ({len(fresh)} files)")


if __name__ == "__main__":
    main()
