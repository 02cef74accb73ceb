"""`latentfast demo`: every job of the library end to end on the embedded toy models.

Stages (each measured next to a baseline doing the same thing: the specification's per-row way, or
the plain torch a user would write):

1. render synthetic text-line images with Pillow;
2. build a latent cache from them with the toy VAE (padded and ragged layouts), then verify it;
3. train a few toy denoiser steps on batches from ``read_batch`` + the width-bucket sampler + the
   device prefetcher (vs the per-row reader + pad + stack of the specification);
4. normalize + split multiview uint8 clips with the fused op (vs per-view eager torch);
5. encode multiview units balanced across 2 local gloo processes (vs unbalanced);
6. one feature-gradient-replay step, its generator gradient checked against plain backprop.

Prints one summary table and writes ``summary.json`` and ``summary.png`` to ``--out``.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import torch

from . import backends, ops
from .bench.common import median_seconds


def stage_images(ctx: dict) -> dict:
    from .synthetic import render_text_lines

    start = time.perf_counter()
    ctx["manifest"] = render_text_lines(
        os.path.join(ctx["work"], "images"), ctx["lines"], line_height=32, max_line_width=512, seed=0, oversize_fraction=0.0
    )
    seconds = time.perf_counter() - start
    return {"metric": "images/s", "value": ctx["lines"] / seconds, "lines": ctx["lines"]}


def stage_cache(ctx: dict) -> dict:
    from .cache import LatentCache, build_latent_cache, verify_cache
    from .toy import ToyVAE

    vae = ToyVAE(latent_channels=4, seed=0)
    stats: dict = {}
    sizes = {}
    for layout in ("padded", "ragged"):
        out = os.path.join(ctx["work"], f"cache_{layout}")
        build_latent_cache(vae, ctx["manifest"], out, line_height=32, max_line_width=512, batch_size=16, layout=layout,
                           quiet=ctx["quick"], stats=stats if layout == "padded" else None)
        report = verify_cache(out)
        sizes[layout] = os.path.getsize(os.path.join(out, "train.latents.f16.dat"))
        ctx[f"cache_{layout}"] = LatentCache(out)
        if layout == "padded":
            verify_report = report
    assert torch.equal(ctx["cache_padded"][3], ctx["cache_ragged"][3]), "layouts disagree"
    return {
        "metric": "lines/s",
        "value": stats["rows"] / stats["wall_s"],
        "decode_share": stats["decode_s"] / max(stats["decode_s"] + stats["encode_s"], 1e-9),
        "ragged_bytes_vs_padded": sizes["ragged"] / sizes["padded"],
        "verify": {k: v for k, v in verify_report.items() if isinstance(v, (int, float, str))},
        # the original format stores the padded layout: the ratio column shows the disk saved by ragged
        "baseline": sizes["padded"] / 1e6,
        "baseline_unit": "MB padded",
        "baseline_label": "padded layout (the original format), bytes on disk",
        "ratio": sizes["padded"] / sizes["ragged"],
        "ratio_label": "disk: padded / ragged",
        "ratio_kind": "disk size",  # not a speed-up: charted apart
    }


def _spec_batch(cache, indices):
    """The specification's way: one row at a time out of the memmap, then pad with white and stack."""
    rows = [cache[i] for i in indices]
    W = max(r.shape[-1] for r in rows)
    white = cache.white_column
    return torch.stack([torch.cat([r, white.expand(-1, -1, W - r.shape[-1])], dim=-1) for r in rows])


def stage_train(ctx: dict) -> dict:
    from .cache import DevicePrefetcher, WidthBucketBatchSampler

    cache = ctx["cache_ragged"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sampler = WidthBucketBatchSampler(cache.widths, 32, seed=0, drop_last=True)
    batches = list(sampler)
    useful = sum(int(cache.widths[b].sum()) for b in batches) * cache.channels * cache.latent_h * 2
    fast_s = median_seconds(lambda: [cache.read_batch(b) for b in batches], repeat=3, warmup=1)
    spec_s = median_seconds(lambda: [_spec_batch(cache, b) for b in batches], repeat=3, warmup=1)
    for b in batches[:3]:
        assert torch.equal(cache.read_batch(b)[0], _spec_batch(cache, b)), "read_batch differs from the spec's path"

    # a few steps of a toy denoiser fed by the fast path (prefetcher overlaps the next transfer)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(cache.channels, 16, 3, padding=1), torch.nn.GELU(),
                              torch.nn.Conv2d(16, cache.channels, 3, padding=1)).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    losses = []
    source = (cache.read_batch(b, device=device, dtype=torch.float32) for b in batches * ctx["epochs"])
    for latents, _ in DevicePrefetcher(source, device=device):
        noise = torch.randn_like(latents)
        loss = torch.nn.functional.mse_loss(net(latents + noise), noise)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {
        "metric": "GB/s",
        "value": useful / fast_s / 1e9,
        "baseline": useful / spec_s / 1e9,
        "baseline_unit": "GB/s",
        "baseline_label": "per-row reader (the specification's): cache[i] per row, pad with white, stack",
        "ratio": spec_s / fast_s,
        "ratio_label": "read_batch vs per-row reader, both allocate their batch",
        "steps": len(losses),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "device": device,
    }


def stage_normalize(ctx: dict) -> dict:
    frames, views, side = (8, 2, 256) if ctx["quick"] else (24, 3, 512)  # full: 38M pixels, past the caches
    clip = torch.randint(0, 256, (2, 3, frames, side, side), dtype=torch.uint8)

    f = frames // views
    fused = ops.normalize_uint8(clip, num_views=views)
    eager = [torch.empty_like(view) for view in fused]

    def eager_into_reused():  # per-view eager torch, writing into reused buffers like the fused op
        for v, target in enumerate(eager):
            target.copy_(clip.narrow(2, v * f, f)).div_(127.5).sub_(1.0)

    # like for like: both sides write into buffers reused across calls (as a training loop does)
    eager_s = median_seconds(eager_into_reused, repeat=5, warmup=1)
    fused_s = median_seconds(lambda: ops.normalize_uint8(clip, num_views=views, out=fused), repeat=5, warmup=1)
    assert all(torch.equal(a, b) for a, b in zip(eager, fused)), "fused normalize differs from eager"
    moved = clip.numel() * 5
    return {
        "metric": "GB/s",
        "value": moved / fused_s / 1e9,
        "baseline": moved / eager_s / 1e9,
        "baseline_unit": "GB/s",
        "baseline_label": "per-view eager torch: copy_ (uint8 -> float) then div_ and sub_ in place",
        "ratio": eager_s / fused_s,
        "ratio_label": "fused op vs per-view eager, both into reused buffers",
        "backend": backends.resolve("normalize_uint8_into", "cpu"),
    }


def stage_balance(ctx: dict) -> dict:
    from .vision.demo import demo_balanced_encode

    result = demo_balanced_encode(world_size=2, repeats=2 if ctx["quick"] else 3, device_seconds=0.02)
    if not result["equal_to_local"]:
        raise AssertionError("balanced latents differ from encoding every item locally")
    return {
        "metric": "steps/s",
        "value": 1.0 / result["balanced_s"],
        "baseline": 1.0 / result["unbalanced_s"],
        "baseline_unit": "steps/s",
        "baseline_label": "unbalanced: every rank encodes its own units",
        "ratio": result["unbalanced_s"] / result["balanced_s"],
        "ratio_label": "balanced vs unbalanced step (2 gloo ranks, skewed batch, 20 ms device wait per encode)",
        "details": result,
    }


def stage_replay(ctx: dict) -> dict:
    from .replay.demo import demo_replay_step

    # float64, two replayed microbatches, each inside gradient_sync(model, enabled=<last>): the
    # replayed gradient is bit-equal to plain backprop (more replays differ by summation order only)
    result = demo_replay_step()
    if result["max_relative_error"] > 1e-12:
        raise AssertionError(f"replayed gradient differs from plain backprop: {result['max_relative_error']:.3g}")
    return {
        "metric": "max rel. grad error",
        "value": result["max_relative_error"],
        "ratio_label": "replayed gradient equals plain backprop",
        "details": result,
    }


STAGES = {
    "images": stage_images,
    "cache": stage_cache,
    "train": stage_train,
    "normalize": stage_normalize,
    "balance": stage_balance,
    "replay": stage_replay,
}


def _print_table(stages: dict, load: float) -> None:
    print(f"\nhost load average {load:.1f} on {os.cpu_count()} CPUs (other work on the host slows every figure)")
    print(f"{'stage':<10} {'latentfast':>24} {'baseline':>20} {'ratio (x)':>9}  what the ratio compares")
    for name, r in stages.items():
        if "error" in r:
            print(f"{name:<10} FAILED: {r['error']}")
            continue
        value = f"{r['value']:.3g} {r['metric']}"
        baseline = "-" if r.get("baseline") is None else f"{r['baseline']:.3g} {r['baseline_unit']}"
        ratio = f"{r['ratio']:.2f}" if "ratio" in r else "-"
        print(f"{name:<10} {value:>24} {baseline:>20} {ratio:>9}  {r.get('ratio_label', '')}")
    print("baselines:")
    for name, r in stages.items():
        if r.get("baseline_label"):
            print(f"  {name:<10} {r['baseline_label']}")


def _chart(stages: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = chart_figure(stages, plt, os.getloadavg()[0])
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def chart_figure(stages: dict, plt, load: float):
    """The summary chart: speed-ups in one panel, the disk-size ratio in its own, every label
    inside the figure, the stages without a ratio (or that failed) named, the host load in the title."""
    import textwrap

    speed = [n for n, r in stages.items() if "ratio" in r and "ratio_kind" not in r]
    disk = [n for n, r in stages.items() if "ratio" in r and "ratio_kind" in r]
    fig, (ax, disk_ax) = plt.subplots(1, 2, figsize=(10, 4.6), gridspec_kw={"width_ratios": [3, 1]})
    for axis, names, xlabel in ((ax, speed, "speed-up: latentfast / baseline (x, higher is better)"),
                                (disk_ax, disk, "disk size ratio (x)")):
        values = [stages[n]["ratio"] for n in names]
        axis.barh(names, values, color="#3b7dd8" if axis is ax else "#8a8a8a")
        axis.axvline(1.0, color="k", lw=0.8)
        axis.set_xlim(0, 1.3 * max(values + [1.0]))  # room for the value labels inside the axes
        for i, value in enumerate(values):
            axis.text(value, i, f" {value:.2f}x", va="center", fontsize=8)
        axis.set_xlabel(xlabel, fontsize=8)
        axis.invert_yaxis()
    notes = [f"{n}: {stages[n]['ratio_label']}" for n in speed + disk]
    for name, r in stages.items():
        if "error" in r:
            notes.append(f"{name}: FAILED ({r['error'][:80]})")
        elif "ratio" not in r:
            notes.append(f"{name}: not charted (no ratio: {r.get('ratio_label') or r.get('metric', 'a check')},"
                         f" {r.get('value', float('nan')):.3g} {r.get('metric', '')})")
    fig.text(0.01, 0.01, "\n".join(textwrap.fill(note, 150) for note in notes), fontsize=7, va="bottom")
    fig.suptitle(f"latentfast demo (host load average {load:.1f} on {os.cpu_count()} CPUs)", fontsize=10)
    fig.tight_layout(rect=(0, 0.04 + 0.035 * len(notes), 1, 1))
    return fig


def run_demo(out_dir: str = "latentfast-demo", quick: bool = False) -> dict:
    print(backends.describe(), flush=True)
    os.makedirs(out_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="latentfast-demo-")
    ctx = {"quick": quick, "work": work, "lines": 160 if quick else 480, "epochs": 1 if quick else 3}
    summary: dict = {"quick": quick, "torch": torch.__version__, "stages": {}}
    failed = []
    try:
        for name, stage in STAGES.items():
            print(f"\n--- {name}", flush=True)
            start = time.perf_counter()
            try:
                result = stage(ctx)
            except ImportError as exc:
                result = {"error": f"missing dependency: {exc} (reinstall latentfast: pip install --no-build-isolation -e .)"}
            except Exception as exc:  # report every stage, then fail
                result = {"error": f"{type(exc).__name__}: {exc}"}
            result["seconds"] = time.perf_counter() - start
            summary["stages"][name] = result
            if "error" in result:
                failed.append(name)
                print(f"stage {name} FAILED: {result['error']}", file=sys.stderr, flush=True)
            else:
                print(f"done in {result['seconds']:.1f} s", flush=True)
            if name == "images" and "error" in result:
                break  # every later stage needs the images
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary["load_average_1min"] = os.getloadavg()[0]
    _print_table(summary["stages"], summary["load_average_1min"])
    path = os.path.join(out_dir, "summary.json")
    with open(path, "w") as fh:
        json.dump(summary, fh, indent=2, default=str)
    chart = os.path.join(out_dir, "summary.png")
    wrote_chart = _chart(summary["stages"], chart)
    print(f"\nsummary: {path}" + (f", chart: {chart}" if wrote_chart else " (no chart: pip install matplotlib)"))
    if failed:
        raise SystemExit(f"latentfast demo: stage(s) failed: {', '.join(failed)}")
    return summary
