"""Latent sampling ``mean + std * eps`` against torch's ``mean + std * torch.randn(...)``, like for like.

Providers (float32 mean, std and output, batches of 64 latents):

- ``torch``: eps from ``torch.randn`` (a stateful generator: the draw an item gets depends on its
  batch and on everything drawn before it, which is what the counter-based sampler avoids);
- ``reference``: :func:`latentfast.sampling.sample_latents_reference` (pure torch, Philox on int64
  tensors: the oracle, not meant to be fast);
- ``cpp``: the op ``ops.sample_latents(..., backend="cpp")``, the C++ kernel of
  ``csrc/cpu/sample_latents_kernel.cpp`` (CPU only; on torch's ``--threads``, as torch is);
- ``triton``: the op's Triton kernel (``latentfast/kernels/sample_latents.py``; CUDA only: on a CPU it runs only
  under Triton's interpreter, which is not timed).

Two settings, each compared only within itself:

- ``alloc``: every call allocates its output (torch: ``mean + std * torch.randn(shape)``);
- ``reuse``: every call writes into an output allocated once (torch: ``torch.randn(out=eps)`` and
  ``torch.addcmul(mean, std, eps, out=out)``; the reference still allocates its temporaries and only
  reuses the output, the C++ and Triton kernels allocate nothing).

GB/s counts the useful bytes alike for every provider: mean and std read, the output written (12 bytes
per element). Samples are taken round-robin; each ratio is the median and range over ``--runs``
repetitions of the whole measurement.

    python -m latentfast.bench.bench_sampling [--quick] [--runs 3] [--threads N]
"""
from __future__ import annotations

import statistics
import sys

import torch

from latentfast import ops
from latentfast.bench.common import format_table, interleaved_median_seconds
from latentfast.sampling import item_seeds, sample_latents_reference
from latentfast.testing import runnable_backends, torch_threads

BATCH = 64
# latent shapes per item: SD 512px (4x64x64), Flux/SD3 512px (16x64x64)
ITEM_SHAPES = ((4, 64, 64), (16, 64, 64))
QUICK_ITEM_SHAPES = ((4, 64, 64),)
BYTES_PER_ELEMENT = 12


def kernels(device: str) -> list[str]:
    """The op's compiled backends that can be timed here: cpp on CPU, triton on CUDA (not the interpreter)."""
    wanted = {"cpu": ("cpp",), "cuda": ("triton",)}[device]
    return [name for name in runnable_backends("sample_latents_into", device) if name in wanted]


def providers(device: str) -> dict:
    """setting -> provider -> fn(mean, std, seeds, out, eps); each returns the sampled batch."""
    generator = torch.Generator(device=device).manual_seed(0)

    def torch_alloc(mean, std, seeds, out, eps):
        return mean + std * torch.randn(mean.shape, generator=generator, device=mean.device)

    def torch_reuse(mean, std, seeds, out, eps):
        torch.randn(mean.shape, generator=generator, device=mean.device, out=eps)
        return torch.addcmul(mean, std, eps, out=out)

    alloc = {"torch": torch_alloc, "reference": lambda mean, std, seeds, out, eps: sample_latents_reference(mean, std, seeds)}
    reuse = {"torch": torch_reuse,
             "reference": lambda mean, std, seeds, out, eps: sample_latents_reference(mean, std, seeds, out=out)}
    for name in kernels(device):
        alloc[name] = lambda mean, std, seeds, out, eps, name=name: ops.sample_latents(mean, std, seeds, backend=name)
        reuse[name] = lambda mean, std, seeds, out, eps, name=name: ops.sample_latents(mean, std, seeds, out=out,
                                                                                        backend=name)
    return {"alloc": alloc, "reuse": reuse}


def measure(item_shape, device: str, quick: bool) -> dict:
    """GB/s of every provider in both settings for one batch shape, sampled round-robin."""
    g = torch.Generator(device=device).manual_seed(1)
    shape = (BATCH, *item_shape)
    mean = torch.randn(shape, generator=g, device=device)
    std = torch.rand(shape, generator=g, device=device)
    seeds = item_seeds([f"img/{i:06d}" for i in range(BATCH)], 0, 1).to(device)
    out, eps = torch.empty_like(mean), torch.empty_like(mean)
    fns = {f"{name}_{setting}": (lambda fn=fn: fn(mean, std, seeds, out, eps))
           for setting, table in providers(device).items() for name, fn in table.items()}
    seconds = interleaved_median_seconds(fns, repeat=3 if quick else 5, device=device, min_time=0.05)
    return {key: BYTES_PER_ELEMENT * mean.numel() / s / 1e9 for key, s in seconds.items()} | {"elements": mean.numel()}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]"


def run_report(quick: bool = False, runs: int = 3, device: str | None = None, threads: int | None = None) -> dict:
    """``threads``: torch's CPU threads during the measurement (default: as set); on a shared machine one
    thread per provider avoids measuring oversubscription instead of the work."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    shapes = QUICK_ITEM_SHAPES if quick else ITEM_SHAPES
    table = providers(device)
    with torch_threads(threads or torch.get_num_threads()):
        threads = torch.get_num_threads()
        rows = {shape: [measure(shape, device, quick) for _ in range(runs)] for shape in shapes}
    title = f"sample_latents (float32, batch {BATCH}, {device}, {threads} threads, {runs} runs)"
    for setting, names in table.items():
        others = [n for n in names if n != "torch"]
        header = ["item shape", "M elements"] + [f"{n} GB/s" for n in names] + [f"{n}/torch x" for n in others]
        cells = []
        for shape, runs_ in rows.items():
            line = ["x".join(map(str, shape)), f"{runs_[0]['elements'] / 1e6:.2f}"]
            line += [spread([r[f"{n}_{setting}"] for r in runs_]) for n in names]
            line += [spread([r[f"{n}_{setting}"] / r[f"torch_{setting}"] for r in runs_]) for n in others]
            cells.append(line)
        print(format_table(f"{title}, {setting}", header, cells))
    print("  GB/s: 12 bytes per element (mean + std read, output written); x: provider GB/s / torch GB/s, "
          "median [range] over the runs")
    if device == "cpu":
        print("  triton: not timed here (needs CUDA; on a CPU the kernel only runs under Triton's interpreter)")
    return {"device": device, "rows": {"x".join(map(str, s)): r for s, r in rows.items()}}


def _option(name: str, default):
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


if __name__ == "__main__":
    run_report(quick="--quick" in sys.argv, runs=_option("--runs", 3), threads=_option("--threads", None))
