"""`latentfast bench`: run every benchmark suite's side-by-side report, write JSON (+ PNG plots).

The suites live in the repository's ``bench/`` folder, installed as ``latentfast.bench``
(``bench_<suite>.py``, each with a ``run_report(quick) -> dict``); they are the same files
``pytest latentfast/bench/ --benchmark-only`` runs.
"""
from __future__ import annotations

import importlib
import json
import os
import time
import traceback

SUITES = ("normalize", "decode", "cache", "build", "fields", "trainers", "balance", "replay", "sampling", "sampler", "remote", "scale",
          "index")


def load_suite(name: str):
    """The suite module ``latentfast.bench.bench_<name>`` (the repository's ``bench/`` folder, installed
    as a subpackage)."""
    if name not in SUITES:
        raise SystemExit(f"unknown suite {name!r}; choose from {SUITES}")
    return importlib.import_module(f"latentfast.bench.bench_{name}")


def run_benchmarks(out_dir: str = "latentfast-bench", quick: bool = False, suites: list[str] | None = None) -> dict:
    from .backends import describe
    from .progress import heartbeat

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
            with heartbeat(f"bench {name}"):  # a suite measures for minutes before it prints its table
                results["suites"][name] = module.run_report(quick=quick)
            if hasattr(module, "plot"):
                results.setdefault("plots", []).extend(module.plot(results["suites"][name], out_dir))
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
