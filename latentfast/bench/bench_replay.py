"""Feature gradient replay: memory of a replay step, the cotangent scatter, and gradient reductions
under DDP.

1. **Step memory** at B = 32, microbatch 4, sweeping b (so b/micro = 1, 2, 4, 8 replayed
   microbatches). Baselines: ``plain (all graphs)`` -- every microbatch keeps its graph until the
   backward, as a direct implementation does; ``plain (fair)`` -- the B - b unselected microbatches
   run under ``no_grad`` (they enter the loss as values only, so the gradients are identical). The
   fair baseline holds the graphs of the b selected rows at once; replay holds one microbatch's
   graph at a time, so it saves activation memory only when b > micro (at b = micro the two are the
   same computation and the ratio is ~1: the benefit cannot show). Peak memory above the step's
   starting point (CPU: the allocator's alloc/free events from the profiler, largest of three
   runs; CUDA: ``max_memory_allocated``), including the parameter gradients both paths produce.
2. **Scatter**, 3 branches x 8 microbatches of 2 rows, world size 2 (scale 2), contiguous float32
   gradients as autograd returns them; every provider produces the scaled (FSDP) block of every
   (microbatch, branch) -- the loop also its local list -- and the op's timings include making the
   views of those blocks (it makes views on first access). Like for like: ``fresh`` --
   every provider allocates its outputs (the op a new arena); ``reuse`` -- every provider writes
   into buffers kept from the previous call (the op: ``reuse=`` the previous result, what
   ``FeatureGradientReplay`` does from its second step on). Each figure is the fastest of many
   single runs (microsecond work on a shared machine: a preempted run is only ever slower).
   Baselines: ``loop`` -- the
   specification's split -> contiguous -> mul -> contiguous per block; ``mul+split`` -- one ``mul``
   per branch, then ``split`` (what a user would write).
3. **DDP**, 2 gloo ranks (spawned processes, CPU), 4 replayed microbatches per step: gradient
   reductions per step (a DDP comm hook counts them) and step time, every replay synced vs
   ``gradient_sync`` (only the last replay reduces).

    pytest latentfast/bench/bench_replay.py --benchmark-only   # pytest-benchmark tables (step, scatter)
    python -m latentfast.bench.bench_replay [--quick]          # side-by-side tables (all three)
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import pytest
import torch

from latentfast import backends
from latentfast.bench.common import best_seconds, cpu_us_per_call, format_table, line_plot, median_seconds, sync
from latentfast.replay import scatter_cotangents
from latentfast.replay.demo import build_toy_problem, generator_gradients, max_relative_error, plain_step, replay_step
from latentfast.testing import teardown_process_group

STEP_B, STEP_MICRO = 32, 4
SWEEP_b = (4, 8, 16, 32)
QUICK_SWEEP_b = (4, 16)
# out = 3 x 8 x 32 x 32 = 24576 values per sample; hidden = 8 keeps the parameters (~0.9 MB)
# small next to the saved activations of 32 clips (~3 MB in float32)
GENERATOR = dict(noise_dim=16, cond_dim=8, hidden=8, depth=2, frames=8, height=32, width=32)
STEP_PROVIDERS = ("plain (all graphs)", "plain (fair)", "replay")

MICROBATCHES, MICROBATCH_ROWS, WORLD_SCALE = 8, 2, 2.0
# per-sample feature geometries (N, D) of the three branches, small -> large
SCATTER_SIZES = {
    "small": ((16, 64), (8, 128), (1, 256)),
    "medium": ((64, 384), (16, 768), (1, 1024)),
    "large": ((256, 768), (64, 1024), (4, 1536)),
}
QUICK_SCATTER_SIZES = ("small", "medium")
SCATTER_LEGEND = (
    "loop: split -> contiguous -> mul -> contiguous per (microbatch, branch) block (the specification's way, "
    "local and scaled lists); mul+split: one mul per branch, then split (the scaled blocks); op: "
    "latentfast.replay.scatter_cotangents ({backend}), one pass, with the views of every scaled block made (local "
    "blocks: views of the gradients, made when read). fresh: every provider allocates its outputs; reuse: every "
    "provider writes into the previous call's buffers."
)

DDP_B, DDP_b, DDP_MICRO = 16, 8, 2  # 4 replayed microbatches per rank and step
# a generator whose parameters (1.9 M, 7.4 MB in float32) dominate its work, as in real trainers
# where the reduction is what costs: with small parameters, 4 or 1 all-reduces cost the same
DDP_GENERATOR = dict(noise_dim=16, cond_dim=8, hidden=512, depth=2, frames=4, height=16, width=16)


# ---- 1. step memory ------------------------------------------------------------------------
def step_problem(device: str, gradient_local_samples: int = 4):
    return build_toy_problem(
        local_samples=STEP_B, gradient_local_samples=gradient_local_samples, microbatch=STEP_MICRO,
        dtype=torch.float32, dropout=0.1, generator_kwargs=GENERATOR, device=device,
    )  # fmt: skip


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
        if provider == "replay":
            replay_step(problem)
        else:
            plain_step(problem, detach_unselected=provider == "plain (fair)")

    return run


def _step_row(device: str, b: int, repeat: int) -> dict:
    problem = step_problem(device, b)
    plain_step(problem, detach_unselected=True)
    reference = generator_gradients(problem)
    replay_step(problem)
    row = {"B": STEP_B, "b": b, "micro": STEP_MICRO, "replays": b // STEP_MICRO,
           "max_rel_error": max_relative_error(reference, generator_gradients(problem))}  # fmt: skip
    for provider in STEP_PROVIDERS:
        fn = step_fn(problem, provider)
        fn()
        # the largest of three profiled runs: the CPU event trace varies a little between runs
        row[f"{provider}_peak_MB"] = max(peak_bytes(fn, device) for _ in range(3)) / 1e6
        row[f"{provider}_ms"] = median_seconds(fn, repeat=repeat, warmup=1, device=device) * 1e3
    row["replay_over_fair_peak"] = row["replay_peak_MB"] / row["plain (fair)_peak_MB"]
    row["replay_over_fair_time"] = row["replay_ms"] / row["plain (fair)_ms"]
    return row


def step_report(device: str, quick: bool) -> list[dict]:
    rows = [_step_row(device, b, 3 if quick else 5) for b in (QUICK_SWEEP_b if quick else SWEEP_b)]
    header = ["b (samples)", "replays (b/micro)"] + [f"{p} peak MB" for p in STEP_PROVIDERS] + ["replay/fair peak (x)"]
    header += [f"{p} ms" for p in STEP_PROVIDERS] + ["replay/fair time (x)", "max rel err (ratio)"]
    table = [
        [r["b"], r["replays"], *(r[f"{p}_peak_MB"] for p in STEP_PROVIDERS), r["replay_over_fair_peak"],
         *(r[f"{p}_ms"] for p in STEP_PROVIDERS), r["replay_over_fair_time"], r["max_rel_error"]]
        for r in rows
    ]  # fmt: skip
    print(format_table(f"replay step vs plain backprop (B={STEP_B}, microbatch={STEP_MICRO}, float32, {device})", header, table))
    print("legend: plain (all graphs): every microbatch keeps its graph; plain (fair): unselected microbatches under "
          "no_grad (same gradients); replay: FeatureGradientReplay + one replayed microbatch at a time. At b = micro "
          "replay and the fair baseline are the same computation: the benefit grows with b/micro.")  # fmt: skip
    return rows


# ---- 2. scatter ------------------------------------------------------------------------------
def scatter_inputs(size: str, device: str):
    generator = torch.Generator().manual_seed(0)
    rows = MICROBATCHES * MICROBATCH_ROWS
    grads = [torch.randn(rows, n, d, generator=generator).to(device) for n, d in SCATTER_SIZES[size]]
    return grads, [MICROBATCH_ROWS] * MICROBATCHES


def spec_loop(grads, batch_sizes, scale):
    """The specification's path: per branch split + contiguous, then one mul + contiguous per block."""
    local = [tuple(part.contiguous() for part in grad.split(batch_sizes)) for grad in grads]
    scaled = [tuple((part * scale).contiguous() for part in parts) for parts in local]
    return local, scaled


def mul_split(grads, batch_sizes, scale):
    """What a user would write for the FSDP-scaled blocks: one mul per branch, then split (views)."""
    return [(g * scale).split(batch_sizes) for g in grads]


def _into(fn_name: str, grads, batch_sizes):
    """The ``reuse`` form of a baseline: it writes into buffers allocated once, here."""
    buffers = [torch.empty_like(g) for g in grads]

    def spec_loop_into(g_list, sizes, scale):
        local = [grad.split(sizes) for grad in g_list]
        for parts, buffer in zip(local, buffers):
            for part, out in zip(parts, buffer.split(sizes)):
                torch.mul(part, scale, out=out)
        return local, [b.split(sizes) for b in buffers]

    def mul_split_into(g_list, sizes, scale):
        for grad, buffer in zip(g_list, buffers):
            torch.mul(grad, scale, out=buffer)
        return [b.split(sizes) for b in buffers]

    return spec_loop_into if fn_name == "loop" else mul_split_into


def _touch(scattered):
    """Make the views a trainer reads: every microbatch's FSDP-scaled blocks (the op makes views on
    first access; the baselines return materialized lists)."""
    blocks = scattered.scaled
    for m in range(len(blocks)):
        blocks[m]
    return scattered


def scatter_providers(device: str, grads, batch_sizes) -> dict:
    """``(mode, provider) -> fn(grads, batch_sizes, scale)``; mode is "fresh" or "reuse"."""
    table = {("fresh", "loop"): spec_loop, ("fresh", "mul+split"): mul_split}
    table[("reuse", "loop")] = _into("loop", grads, batch_sizes)
    table[("reuse", "mul+split")] = _into("mul+split", grads, batch_sizes)
    for name, why in backends.availability("scatter_cotangents_into", device).items():
        if why:
            continue
        table[("fresh", name)] = lambda g, s, scale, name=name: _touch(scatter_cotangents(g, s, scale=scale, backend=name))
        previous = [_touch(scatter_cotangents(grads, batch_sizes, scale=WORLD_SCALE, backend=name))]

        def reuse(g, s, scale, name=name, previous=previous):
            previous[0] = _touch(scatter_cotangents(g, s, scale=scale, backend=name, reuse=previous[0]))
            return previous[0]

        table[("reuse", name)] = reuse
    return table


def _count_cuda_kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower())


def _scatter_row(size: str, device: str, repeat: int, op: str) -> dict:
    grads, batch_sizes = scatter_inputs(size, device)
    row = {"size": size, "MB_in": sum(g.numel() * g.element_size() for g in grads) / 1e6}
    for (mode, name), fn in scatter_providers(device, grads, batch_sizes).items():
        row[f"{mode}_{name}_us"] = best_seconds(lambda: fn(grads, batch_sizes, WORLD_SCALE), repeat=repeat, device=device) * 1e6
    for mode in ("fresh", "reuse"):
        for base in ("loop", "mul+split"):
            row[f"{mode}_{base}_over_op"] = row[f"{mode}_{base}_us"] / row[f"{mode}_{op}_us"]
    if device == "cuda":
        row["cuda_kernel_launches"] = _count_cuda_kernels(
            lambda: scatter_cotangents(grads, batch_sizes, scale=WORLD_SCALE, backend=op)
        )
    return row


def scatter_report(device: str, quick: bool) -> list[dict]:
    op = "cuda" if device == "cuda" else "cpp"
    if backends.availability("scatter_cotangents_into", device)[op]:
        op = "torch"  # no compiled kernel here: the reference stands in
    repeat = 30 if quick else 100
    rows = [_scatter_row(size, device, repeat, op) for size in (QUICK_SCATTER_SIZES if quick else SCATTER_SIZES)]
    names = ("loop", "mul+split", op)
    header = ["features", "MB in"] + [f"{mode} {n} us" for mode in ("fresh", "reuse") for n in names]
    header += ["fresh loop/op (x)", "reuse loop/op (x)", "fresh mul+split/op (x)", "reuse mul+split/op (x)"]
    table = [
        [r["size"], r["MB_in"], *(r[f"{mode}_{n}_us"] for mode in ("fresh", "reuse") for n in names),
         r["fresh_loop_over_op"], r["reuse_loop_over_op"], r["fresh_mul+split_over_op"], r["reuse_mul+split_over_op"]]
        for r in rows
    ]  # fmt: skip
    title = (f"scatter_cotangents, 3 branches x {MICROBATCHES} microbatches of {MICROBATCH_ROWS} rows, scale "
             f"{WORLD_SCALE:g} ({device}, {torch.get_num_threads()} threads; microseconds, fastest of {repeat} runs; "
             "ratios > 1: op faster)")  # fmt: skip
    print(format_table(title, header, table))
    print("legend: " + SCATTER_LEGEND.format(backend=op))
    return rows


# ---- 3. DDP: reductions per step ------------------------------------------------------------
def _ddp_worker(rank: int, init_file: str, out_path: str, steps: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        results = _ddp_steps(rank, steps)  # the DDP module is gone when it returns, before the teardown
        if rank == 0:
            with open(out_path, "w") as fh:
                json.dump(results, fh)
    finally:
        teardown_process_group()


def _ddp_steps(rank: int, steps: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    problem = build_toy_problem(
        local_samples=DDP_B, gradient_local_samples=DDP_b, microbatch=DDP_MICRO, num_shards=2,
        dtype=torch.float32, dropout=0.1, generator_kwargs=DDP_GENERATOR,
    )  # fmt: skip
    problem.model = ddp = DistributedDataParallel(problem.generator)
    calls: list = []

    def counting_hook(state, bucket):
        state.append(1)
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(calls, counting_hook)
    results = {"every": [], "deferred": []}
    for step in range(steps + 1):  # step 0 warms up (DDP rebuilds its buckets after it)
        for mode in ("every", "deferred"):  # alternated, so both see the same machine load
            calls.clear()
            dist.barrier()
            start = time.perf_counter()
            replay_step(problem, problem.shards[rank], sync_every_replay=mode == "every")
            elapsed = time.perf_counter() - start
            problem.generator.zero_grad(set_to_none=True)
            if step:
                results[mode].append((elapsed, len(calls)))
    return results


def ddp_report(quick: bool) -> dict:
    import torch.multiprocessing as mp

    steps = 3 if quick else 8
    with tempfile.TemporaryDirectory() as work:
        out_path = os.path.join(work, "ddp.json")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.start_processes(_ddp_worker, args=(os.path.join(work, "init"), out_path, steps), nprocs=2, start_method="spawn")
        with open(out_path) as fh:
            raw = json.load(fh)
    parameters = build_toy_problem(generator_kwargs=DDP_GENERATOR).generator.parameters()
    report = {"ranks": 2, "backend": "gloo", "replays_per_step": DDP_b // DDP_MICRO, "steps": steps,
              "parameters_M": sum(p.numel() for p in parameters) / 1e6}  # fmt: skip
    for mode, samples in raw.items():
        report[f"{mode}_reductions_per_step"] = statistics.median(count for _, count in samples)
        report[f"{mode}_step_ms"] = statistics.median(seconds for seconds, _ in samples) * 1e3
    report["time_ratio_every_over_deferred"] = report["every_step_ms"] / report["deferred_step_ms"]
    header = ["gradient sync", "reductions / step", "step ms"]
    table = [["every replay", report["every_reductions_per_step"], report["every_step_ms"]],
             ["gradient_sync (last replay)", report["deferred_reductions_per_step"], report["deferred_step_ms"]]]  # fmt: skip
    print(format_table(f"DDP replay step, 2 gloo ranks on CPU, {report['replays_per_step']} replays per step "
                       f"(B={DDP_B}, b={DDP_b}, microbatch {DDP_MICRO}, {report['parameters_M']:.2f} M float32 "
                       f"parameters; medians of {steps} steps)", header, table))  # fmt: skip
    print("legend: every replay: each replay_backward all-reduces (DDP's default); gradient_sync: "
          "latentfast.replay.gradient_sync defers all but the last replay's reduction (DDP no_sync).")
    return report


# ---- per-call overhead ---------------------------------------------------------------------
def per_call_report(rounds: int = 7, busy: int = 0) -> dict:
    """Microseconds per call of the kernel-form op on a tiny input (one [1, 2, 4] gradient, two copies:
    no work to speak of), CPU: the fixed cost of the dispatch and of entering the compiled kernel, in
    thread CPU time (see cpu_us_per_call), median [min-max] of ``rounds`` rounds. ``busy``: that many
    other processes spin on a core meanwhile (bench_decode's contended setting)."""
    from latentfast.bench.bench_decode import busy_cores

    grads, arena = [torch.randn(1, 2, 4)], torch.empty(16)
    table = {}
    with busy_cores(busy):
        for backend, why in backends.availability("scatter_cotangents_into", "cpu").items():
            if why:
                continue
            call = lambda b=backend: torch.ops.latentfast.scatter_cotangents_into(grads, [1], [1.0, 2.0], arena, b)  # noqa: E731
            samples = cpu_us_per_call(call, rounds=rounds)
            table[backend] = {"us_median": statistics.median(samples), "us_min": min(samples), "us_max": max(samples)}
            print(f"scatter_cotangents_into per call, backend={backend}, busy={busy}: {table[backend]['us_median']:.2f} us "
                  f"[{table[backend]['us_min']:.2f}-{table[backend]['us_max']:.2f}]")
    return table


# ---- report --------------------------------------------------------------------------------
def run_report(quick: bool = False, device: str | None = None) -> dict:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    results = {"device": device, "threads": torch.get_num_threads()}
    results["step"] = step_report(device, quick)
    results["scatter"] = scatter_report(device, quick)
    results["ddp"] = ddp_report(quick)
    results["per_call"] = {busy: per_call_report(busy=busy) for busy in (0, os.cpu_count() or 1)}
    summary = {"replay_gradient_max_rel_error": max(r["max_rel_error"] for r in results["step"])}
    for row in results["step"]:
        summary[f"step_peak_replay_over_fair_plain_b{row['b']}"] = round(row["replay_over_fair_peak"], 3)
        summary[f"step_peak_replay_over_all_graphs_plain_b{row['b']}"] = round(
            row["replay_peak_MB"] / row["plain (all graphs)_peak_MB"], 3
        )
    for row in results["scatter"]:
        for key in ("fresh_loop_over_op", "reuse_loop_over_op", "fresh_mul+split_over_op", "reuse_mul+split_over_op"):
            summary[f"scatter_{key}_{row['size']}"] = round(row[key], 2)
    ddp = results["ddp"]
    summary.update(
        ddp_reductions_per_step_every_replay=ddp["every_reductions_per_step"],
        ddp_reductions_per_step_gradient_sync=ddp["deferred_reductions_per_step"],
        ddp_step_time_every_over_gradient_sync=round(ddp["time_ratio_every_over_deferred"], 3),
    )
    results["summary"] = summary
    return results


# ---- pytest-benchmark providers -------------------------------------------------------------
@pytest.mark.parametrize("b", SWEEP_b)
@pytest.mark.parametrize("provider", STEP_PROVIDERS)
def test_replay_step(benchmark, provider, b):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fn = step_fn(step_problem(device, b), provider)

    def timed():
        fn()
        sync(device)

    benchmark(timed)


@pytest.mark.parametrize("size", list(SCATTER_SIZES))
@pytest.mark.parametrize("mode", ["fresh", "reuse"])
@pytest.mark.parametrize("provider", ["loop", "mul+split", "torch", "cpp", "cuda"])
def test_scatter(benchmark, provider, mode, size):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    grads, batch_sizes = scatter_inputs(size, device)
    table = scatter_providers(device, grads, batch_sizes)
    if (mode, provider) not in table:
        pytest.skip(f"{provider} not available on {device}")

    def timed():
        table[(mode, provider)](grads, batch_sizes, WORLD_SCALE)
        sync(device)

    benchmark(timed)


def plot(report: dict, out_dir: str) -> list[str]:
    """Peak memory of one step vs b (B and microbatch fixed): both plain baselines and replay."""
    rows = report["step"]
    series = {p: [r[f"{p}_peak_MB"] for r in rows] for p in STEP_PROVIDERS}
    return line_plot(out_dir, "replay_memory.png", [r["b"] for r in rows], series,
                     xlabel=f"b (rows differentiated; B = {rows[0]['B']}, microbatch {rows[0]['micro']})",
                     ylabel="peak MB", title=f"replay step memory ({report['device']})")  # fmt: skip


if __name__ == "__main__":
    if "--per-call" in sys.argv:
        for busy in (0, os.cpu_count() or 1):
            per_call_report(busy=busy)
    else:
        run_report(quick="--quick" in sys.argv)
