"""The client distribution's console commands, importable without its extras: each says
which extra it needs instead of failing with an import traceback (`pip install radixkv`
alone installs them too)."""

import sys

EXTRA_OF = {"torch": "buffers", "numpy": "buffers"}  # what the simulator imports, by extra


def sim(argv=None) -> int:
    """`radixkv-sim`: radixkv.sim.cli.main, once torch and numpy import."""
    try:
        from .sim.cli import main
    except ModuleNotFoundError as e:
        if e.name not in EXTRA_OF:
            raise
        print(f"radixkv-sim needs {e.name}: pip install 'radixkv[{EXTRA_OF[e.name]}]' (or use the engine's own "
              f"{e.name})", file=sys.stderr)
        return 2
    return main(argv)


__all__ = ["sim"]
