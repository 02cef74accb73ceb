"""latentfast's benchmark suites (``latentfast.bench``); ``bench/`` at the checkout's top holds their results.

Each ``bench_<suite>.py`` is a pytest-benchmark module and has ``run_report(quick) -> dict`` (the
side-by-side table ``latentfast bench`` prints); ``common`` holds their timing, table and plot helpers.
Run one suite with ``python -m latentfast.bench.bench_<suite>`` (or ``latentfast bench --suite <suite>``).
"""
