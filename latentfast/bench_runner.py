"""`latentfast bench`: run every benchmark suite's side-by-side report, write JSON (+ PNG plots).

The suites live in the repository's ``bench/`` folder (``bench_<suite>.py``, each with a
``run_report(quick) -> dict``); they are the same files ``pytest bench/ --benchmark-only`` runs.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys
import time
import traceback

SUITES = ("normalize", "decode", "cache", "balance", "replay")


def bench_dir() -> pathlib.Path:
    """The bench/ folder: $LATENTFAST_BENCH_DIR, the checkout this package was installed from, or ./bench."""
    candidates = [os.environ.get("LATENTFAST_BENCH_DIR"), pathlib.Path(__file__).resolve().parent.parent / "bench", "bench"]
    for candidate in candidates:
        if candidate and (pathlib.Path(candidate) / "common.py").exists():
            return pathlib.Path(candidate).resolve()
    raise FileNotFoundError(
        "latentfast bench needs the repository's bench/ folder (install from a clone with `pip install -e .`, "
        "run from the clone, or set LATENTFAST_BENCH_DIR)"
    )


def load_suite(name: str):
    folder = bench_dir()
    path = folder / f"bench_{name}.py"
    if not path.exists():
        raise FileNotFoundError(f"no benchmark suite {name!r} ({path} does not exist)")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(f"latentfast_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_benchmarks(out_dir: str = "latentfast-bench", quick: bool = False, suites: list[str] | None = None) -> dict:
    from .backends import describe

    unknown = sorted(set(suites or ()) - set(SUITES))
    if unknown:
        raise SystemExit(f"unknown suite(s) {unknown}; choose from {SUITES}")
    os.makedirs(out_dir, exist_ok=True)
    print(describe(), flush=True)
    results: dict = {"quick": quick, "suites": {}, "errors": {}}
    for name in suites or SUITES:
        print(f"\n=== {name} ===", flush=True)
        start = time.perf_counter()
        try:
            module = load_suite(name)
            results["suites"][name] = module.run_report(quick=quick)
            if hasattr(module, "plot"):
                results.setdefault("plots", []).extend(module.plot(results["suites"][name], out_dir))
        except FileNotFoundError as exc:
            results["errors"][name] = str(exc)
            print(f"skipped: {exc}")
        except Exception as exc:  # one broken suite must not hide the others' figures
            results["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        print(f"({name}: {time.perf_counter() - start:.1f} s)", flush=True)
    path = os.path.join(out_dir, "bench.json")
    with open(path, "w") as fh:
        json.dump(results, fh, indent=2, default=str)
    plots = results.get("plots", [])
    print(f"\nresults written to {path}" + (f"; plots: {', '.join(plots)}" if plots else " (no plots: install matplotlib)"))
    if results["errors"]:
        raise SystemExit(f"benchmark suites failed: {results['errors']}")
    return results
