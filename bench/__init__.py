"""latentfast's benchmark suites, installed as ``latentfast.bench`` (like ``kernels/`` -> ``latentfast.kernels``).

Each ``bench_<suite>.py`` is a pytest-benchmark module and has ``run_report(quick) -> dict`` (the
side-by-side table ``latentfast bench`` prints); ``common`` holds their timing, table and plot helpers.
Run one suite with ``python bench/bench_<suite>.py`` or ``python -m latentfast.bench.bench_<suite>``.
"""
