"""Feature gradient replay: one replay step vs plain full-B backprop, and the cotangent scatter.

1. **Step** at B = 32, b = 4 (microbatch 4) on a toy generator whose activations dominate its
   parameters: peak memory above the step's starting point (CPU: the allocator's alloc/free
   events recorded by the profiler, largest of three runs; CUDA: ``max_memory_allocated``) and
   wall time. The peak
   includes the parameter gradients the backward produces (they are the floor of both paths).
   The title reports the replayed gradient's max relative error against the plain step.
2. **Scatter**, 3 branches x 8 microbatches: ``scatter_cotangents`` (cpp / cuda / torch reference)
   vs the specification's Python loop (split -> contiguous -> mul per block) vs the same with one
   ``torch._foreach_mul``. The op's views are made on first access, so it is timed bare, with the
   views a trainer reads (``+views``: every microbatch's scaled/FSDP blocks) and with both sets
   (``+all views``); once into a fresh arena per call (a first step: fresh pages, new views) and
   once overwriting the previous call's result (``reuse``: its arena and views are kept -- what
   ``FeatureGradientReplay`` does from its second step on).

    pytest bench/bench_replay.py --benchmark-only   # pytest-benchmark tables
    python bench/bench_replay.py [--quick]          # side-by-side ratios
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from latentfast import backends
from latentfast.replay import scatter_cotangents
from latentfast.replay.demo import build_toy_problem, generator_gradients, max_relative_error, plain_step, replay_step

from latentfast.bench.common import format_table, line_plot, median_seconds, sync

STEP = dict(local_samples=32, gradient_local_samples=4, microbatch=4)
# out = 3 x 8 x 32 x 32 = 24576 values per sample; hidden = 8 keeps the parameters (~0.9 MB)
# small next to the saved activations of 32 clips (~3 MB in float32)
GENERATOR = dict(noise_dim=16, cond_dim=8, hidden=8, depth=2, frames=8, height=32, width=32)
MICROBATCHES = 8
MICROBATCH_ROWS = 2
# per-sample feature geometries (N, D) of the three branches, small -> large
SCATTER_SIZES = {
    "small": ((16, 64), (8, 128), (1, 256)),
    "medium": ((64, 384), (16, 768), (1, 1024)),
    "large": ((256, 768), (64, 1024), (4, 1536)),
}
QUICK_SCATTER_SIZES = ("small", "medium")
# the scatter table's ratio columns: the loop (or foreach) time over the op's
RATIO_KEYS = ("op_views_vs_loop", "reuse_views_vs_loop", "reuse_all_views_vs_loop", "reuse_views_vs_foreach")


# ---- replay step ---------------------------------------------------------------------------
# the memory-vs-B sweep (b fixed at 4): plain backprop grows with B, replay with b only
SWEEP_B = (8, 16, 32, 64)
QUICK_SWEEP_B = (8, 32)


def step_problem(device: str, local_samples: int = STEP["local_samples"]):
    return build_toy_problem(
        **{**STEP, "local_samples": local_samples}, dtype=torch.float32, dropout=0.1, generator_kwargs=GENERATOR, device=device
    )


def _cpu_peak_bytes(fn) -> int:
    """Peak of (allocated - freed) bytes on the CPU while ``fn`` runs, from the profiler's events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type().name == "CPU"]
    current = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def peak_bytes(fn, device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    return _cpu_peak_bytes(fn)


def step_fn(problem, provider: str):
    def run():
        problem.generator.zero_grad(set_to_none=True)
        if provider == "plain":
            plain_step(problem)
        else:
            replay_step(problem)

    return run


# ---- scatter -------------------------------------------------------------------------------
def scatter_inputs(size: str, device: str):
    generator = torch.Generator().manual_seed(0)
    rows = MICROBATCHES * MICROBATCH_ROWS
    grads = [torch.randn(rows, n, d, generator=generator).to(device) for n, d in SCATTER_SIZES[size]]
    return grads, [MICROBATCH_ROWS] * MICROBATCHES


def python_loop(grads, batch_sizes, scale):
    """The specification's path: per branch split + contiguous, then one mul + contiguous per block."""
    local = [tuple(part.contiguous() for part in grad.split(batch_sizes)) for grad in grads]
    scaled = [tuple((part * scale).contiguous() for part in parts) for parts in local]
    return local, scaled


def foreach_loop(grads, batch_sizes, scale):
    local = [part.contiguous() for grad in grads for part in grad.split(batch_sizes)]
    return local, torch._foreach_mul(local, scale)


def _touch(scattered, kinds=("scaled",)):
    """Make the views a trainer reads: every microbatch's blocks of each kind."""
    for kind in kinds:
        blocks = getattr(scattered, kind)
        for m in range(len(blocks)):
            blocks[m]
    return scattered


def scatter_providers(device: str, grads=None, batch_sizes=None) -> dict:
    """name -> fn(grads, batch_sizes, scale). With inputs given, adds the compiled op's ``+views``
    and ``reuse`` variants (the reused arena is sized for those inputs)."""
    table = {"loop": python_loop, "foreach": foreach_loop}
    for name, why in backends.availability("scatter_cotangents_into", device).items():
        if not why:
            table[name] = lambda g, s, scale, name=name: scatter_cotangents(g, s, scale=scale, backend=name)
    op = "cuda" if device == "cuda" else "cpp"
    if op in table and grads is not None:
        table[f"{op}+views"] = lambda g, s, scale: _touch(scatter_cotangents(g, s, scale=scale, backend=op))
        # like FeatureGradientReplay from its second step on: each call overwrites the previous
        # result's arena and keeps its views
        previous = [_touch(scatter_cotangents(grads, batch_sizes, scale=1.0, backend=op), ("local", "scaled"))]

        def reuse(g, s, scale, kinds=()):
            previous[0] = _touch(scatter_cotangents(g, s, scale=scale, backend=op, reuse=previous[0]), kinds)
            return previous[0]

        table["reuse"] = reuse
        table["reuse+views"] = lambda g, s, scale: reuse(g, s, scale, ("scaled",))
        table["reuse+all views"] = lambda g, s, scale: reuse(g, s, scale, ("local", "scaled"))
    return table


def _count_cuda_kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower())


# ---- report --------------------------------------------------------------------------------
def run_report(quick: bool = False, device: str | None = None) -> dict:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    results: dict = {"device": device, "threads": torch.get_num_threads(), "step": [], "scatter": []}
    repeat = 3 if quick else 5

    # 1. replay step vs plain, for several B at b = 4
    table = []
    for B in QUICK_SWEEP_B if quick else SWEEP_B:
        problem = step_problem(device, B)
        parameters_mb = sum(p.numel() * p.element_size() for p in problem.generator.parameters()) / 1e6
        plain_step(problem)
        reference = generator_gradients(problem)
        replay_step(problem)
        error = max_relative_error(reference, generator_gradients(problem))
        row = {"B": B, "b": STEP["gradient_local_samples"], "max_rel_error": error}
        for provider in ("plain", "replay"):
            fn = step_fn(problem, provider)
            fn()
            # the largest of three profiled runs: the CPU event trace varies a little between runs
            row[f"{provider}_peak_MB"] = max(peak_bytes(fn, device) for _ in range(3)) / 1e6
            row[f"{provider}_ms"] = median_seconds(fn, repeat=repeat, warmup=1, device=device) * 1e3
        row["peak_ratio"] = row["replay_peak_MB"] / row["plain_peak_MB"]
        row["time_ratio"] = row["replay_ms"] / row["plain_ms"]
        results["step"].append(row)
        table.append([B, row["plain_peak_MB"], row["replay_peak_MB"], row["peak_ratio"], row["plain_ms"], row["replay_ms"],
                      row["time_ratio"], error])
    print(
        format_table(
            f"replay step vs plain backprop (b={STEP['gradient_local_samples']}, microbatch={STEP['microbatch']},"
            f" generator params {parameters_mb:.2f} MB, {device})",
            ["B", "plain peak MB", "replay peak MB", "replay/plain", "plain ms", "replay ms", "replay/plain", "max rel err"],
            table,
        )
    )
    error = max(row["max_rel_error"] for row in results["step"])

    # 2. scatter
    scatter_rows = []
    for size in QUICK_SCATTER_SIZES if quick else tuple(SCATTER_SIZES):
        grads, batch_sizes = scatter_inputs(size, device)
        providers = scatter_providers(device, grads, batch_sizes)
        names = list(providers)
        row = {"size": size, "MB_in": sum(g.numel() * g.element_size() for g in grads) / 1e6}
        for name, fn in providers.items():
            row[f"{name}_us"] = median_seconds(
                lambda: fn(grads, batch_sizes, 2.0), repeat=repeat + 2, device=device, min_time=0.02
            ) * 1e6
        op = "cuda" if device == "cuda" else "cpp"
        if f"{op}_us" in row:
            row["op_vs_loop"] = row["loop_us"] / row[f"{op}_us"]
            row["op_views_vs_loop"] = row["loop_us"] / row[f"{op}+views_us"]
            row["reuse_views_vs_loop"] = row["loop_us"] / row["reuse+views_us"]
            row["reuse_all_views_vs_loop"] = row["loop_us"] / row["reuse+all views_us"]
            row["reuse_views_vs_foreach"] = row["foreach_us"] / row["reuse+views_us"]
        if device == "cuda" and "cuda" in names:
            row["cuda_kernel_launches"] = _count_cuda_kernels(lambda: scatter_cotangents(grads, batch_sizes, scale=2.0, backend="cuda"))
        results["scatter"].append(row)
        scatter_rows.append(
            [size, row["MB_in"]]
            + [row[f"{n}_us"] for n in names]
            + [row.get(key, "-") for key in RATIO_KEYS]
        )
    print(
        format_table(
            f"scatter_cotangents, 3 branches x {MICROBATCHES} microbatches of {MICROBATCH_ROWS} rows ({device},"
            f" {torch.get_num_threads()} threads; microseconds)",
            ["features", "MB in"]
            + [f"{n} us" for n in names]
            + ["loop/(op+views)", "loop/(reuse+views)", "loop/(reuse+all)", "foreach/(reuse+views)"],
            scatter_rows,
        )
    )
    conservative = next(row for row in results["step"] if row["B"] == STEP["local_samples"])
    results["summary"] = {
        "replay_gradient_max_rel_error": error,
        "step_peak_ratio_replay_over_plain": round(conservative["peak_ratio"], 3),
        "step_time_ratio_replay_over_plain": round(conservative["time_ratio"], 3),
        **{
            f"scatter_speedup_vs_loop_{row['size']}": round(row["op_vs_loop"], 2)
            for row in results["scatter"]
            if "op_vs_loop" in row
        },
        **{
            f"scatter_with_views_speedup_vs_loop_{row['size']}": round(row["op_views_vs_loop"], 2)
            for row in results["scatter"]
            if "op_views_vs_loop" in row
        },
        **{
            f"scatter_reused_arena_with_views_speedup_vs_loop_{row['size']}": round(row["reuse_views_vs_loop"], 2)
            for row in results["scatter"]
            if "reuse_views_vs_loop" in row
        },
    }
    return results


# ---- pytest-benchmark providers -------------------------------------------------------------
@pytest.mark.parametrize("provider", ["plain", "replay"])
def test_replay_step(benchmark, provider):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fn = step_fn(step_problem(device), provider)

    def timed():
        fn()
        sync(device)

    benchmark(timed)


@pytest.mark.parametrize("size", list(SCATTER_SIZES))
@pytest.mark.parametrize(
    "provider",
    ["loop", "foreach", "torch", "cpp", "cpp+views", "cuda", "cuda+views", "reuse", "reuse+views", "reuse+all views"],
)
def test_scatter(benchmark, provider, size):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    grads, batch_sizes = scatter_inputs(size, device)
    table = scatter_providers(device, grads, batch_sizes)
    if provider not in table:
        pytest.skip(f"{provider} not available on {device}")

    def timed():
        table[provider](grads, batch_sizes, 2.0)
        sync(device)

    benchmark(timed)



def plot(report: dict, out_dir: str) -> list[str]:
    """Peak memory of one step vs B (b fixed): plain backprop vs replay."""
    rows = report["step"]
    series = {p: [r[f"{p}_peak_MB"] for r in rows] for p in ("plain", "replay")}
    return line_plot(out_dir, "replay_memory.png", [r["B"] for r in rows], series,
                     xlabel=f"B (samples in the loss; b = {rows[0]['b']} differentiated)", ylabel="peak MB",
                     title=f"replay step memory ({report['device']})")


if __name__ == "__main__":
    run_report(quick="--quick" in sys.argv)
