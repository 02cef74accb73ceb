"""`latentfast demo | bench | cache build | cache inspect | cache verify`."""
from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(out_dir=args.out, quick=args.quick)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench_runner import run_benchmarks

    run_benchmarks(out_dir=args.out, quick=args.quick, suites=args.suite)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="latentfast", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run every job end to end on the embedded toy models")
    demo.add_argument("--out", default="latentfast-demo", help="output folder (summary JSON, chart)")
    demo.add_argument("--quick", action="store_true", help="smaller sizes (used by the tests)")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="run the benchmark suites and print side-by-side ratios")
    bench.add_argument("--out", default="latentfast-bench", help="output folder (JSON, plots)")
    bench.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    bench.add_argument("--suite", action="append", help="run only this suite (repeatable)")
    bench.set_defaults(func=_bench)

    from .cache.cli import add_cache_subparsers

    add_cache_subparsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
