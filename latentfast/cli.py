"""The ``latentfast`` command: ``demo``, ``bench`` and the ``cache`` commands (``latentfast --help`` lists them all)."""
from __future__ import annotations

import argparse
import os
import sys

# torch's profiler (the replay suite measures peak memory with it) logs every start and stop, and
# "gpuGetDeviceCount failed" on a machine without a GPU; it reads these when torch is imported.
QUIET_PROFILER_ENV = {"KINETO_LOG_LEVEL": "6", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(out_dir=args.out, quick=args.quick)
    return 0


def _bench(args: argparse.Namespace) -> int:
    if any(key not in os.environ for key in QUIET_PROFILER_ENV):  # torch is imported already: start afresh
        os.environ.update({key: os.environ.get(key, value) for key, value in QUIET_PROFILER_ENV.items()})
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-m", "latentfast.cli", *sys.argv[1:]])
    from .bench_runner import run_benchmarks

    run_benchmarks(out_dir=args.out, quick=args.quick, suites=args.suite)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .bench_runner import SUITES
    from .cache.cli import HelpFormatter, add_cache_subparsers

    parser = argparse.ArgumentParser(prog="latentfast")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="run every job end to end on the embedded toy models",
        description="Run every job end to end on the embedded toy models and print one table. Writes "
        "summary.json (every figure) and summary.png (chart, needs matplotlib) to --out; intermediate files "
        "(images, caches) go to a temporary folder that is removed afterwards.",
        formatter_class=HelpFormatter,
    )
    demo.add_argument("--out", default="latentfast-demo", help="output folder for summary.json and summary.png")
    demo.add_argument("--quick", action="store_true", help="smaller sizes (used by the tests)")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser(
        "bench",
        help="run the benchmark suites and print side-by-side ratios",
        description="Run the benchmark suites (bench/, installed as latentfast.bench) and print their side-by-side "
        "tables. Writes bench.json (every figure) and PNG plots to --out.",
        formatter_class=HelpFormatter,
    )
    bench.add_argument("--out", default="latentfast-bench", help="output folder for bench.json and the plots")
    bench.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    bench.add_argument("--suite", action="append", choices=SUITES, help="run only this suite (repeatable; default: all)")
    bench.set_defaults(func=_bench)

    add_cache_subparsers(sub)
    parser.description = f"latentfast {' | '.join(command_names(parser))} (COMMAND --help for its options)"
    return parser


def command_names(parser: argparse.ArgumentParser) -> list[str]:
    """Every command ``parser`` runs, from its subparsers: ``["demo", "bench", "cache build", ...]``."""
    names = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                names += [f"{name} {leaf}" for leaf in command_names(sub)] or [name]
    return names


def main(argv: list[str] | None = None) -> int:
    if not sys.stdout.isatty() and hasattr(sys.stdout, "reconfigure"):  # a log (nohup, SLURM) gets each line as printed
        sys.stdout.reconfigure(line_buffering=True)
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
