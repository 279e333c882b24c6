"""python -m tests.fuzz [--minutes N] [--seed S]: run the fuzzing campaign, print its
figures; exit 1 unless it was clean."""

import argparse
import sys

from .campaign import Campaign, report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to fuzz (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="the valid engine's prompt order")
    args = parser.parse_args(argv)
    figures = Campaign(args.seed).run(args.minutes * 60)
    print(report(figures), flush=True)
    return 0 if figures.clean else 1


if __name__ == "__main__":
    sys.exit(main())
