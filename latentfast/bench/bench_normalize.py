"""Fused uint8 -> [-1, 1] normalize (+ view split) against eager torch, like for like.

Two settings, each compared only within itself:

- ``reuse``: every provider writes into output buffers allocated once (a training loop's ``out=``);
- ``alloc``: every provider allocates its outputs on every call (on a CPU the first-touch page faults
  of a fresh buffer can cost more than the arithmetic).

GB/s counts the useful bytes of every provider alike: the uint8 read plus the float32 written, 5 bytes
per element. The copy column is ``dst.copy_(src)`` of a reused float32 buffer of the output's size
(8 bytes per element counted): what the memory system moves in the same run, the ceiling a streaming
pass is compared with. Samples are taken round-robin, so a noisy neighbour slows every provider alike.

    pytest latentfast/bench/bench_normalize.py --benchmark-only      # pytest-benchmark tables
    python -m latentfast.bench.bench_normalize [--quick]             # the side-by-side table
"""
from __future__ import annotations

import sys

import pytest
import torch

from latentfast import backends, ops
from latentfast.bench.common import format_table, interleaved_median_seconds, line_plot, sync

NUM_VIEWS = 2
# input frames of [3, T, 512, 512] uint8: 1.6 MB ... 100 MB (T=32 is the 25M-element target case)
FRAMES = (2, 8, 32, 128)
QUICK_FRAMES = (2, 32)
TARGET_ELEMENTS = 25_165_824

LEGEND = [
    "reuse: outputs allocated once (out=); alloc: every call allocates its outputs",
    "eager: the specification's per-view narrow + to(float32) + div_(127.5) + sub_(1);",
    "       in reuse the same three passes into the buffers (copy_ + div_ + sub_): 21 B/element",
    "eager-2op: torch.div(view, 127.5, out=buf) + buf.sub_(1), also bit-identical: 13 B/element",
    "cpp / triton / cuda: latentfast.ops.normalize_uint8 on that backend, one pass: 5 B/element",
    "copy: float32 dst.copy_(src) of the output's size into a reused buffer (8 B/element counted)",
    "GB/s: 5 bytes per element (uint8 read + float32 written) / time, for every provider but copy",
]


def views_of(x: torch.Tensor):
    frames = x.shape[-3] // NUM_VIEWS
    return [x.narrow(-3, v * frames, frames) for v in range(NUM_VIEWS)]


def eager_alloc(x: torch.Tensor, outs) -> list[torch.Tensor]:
    """The specification's path: one narrow + to(float32) + div_ + sub_ per view, fresh outputs."""
    return [view.to(torch.float32).div_(127.5).sub_(1.0) for view in views_of(x)]


def eager_reuse(x: torch.Tensor, outs) -> list[torch.Tensor]:
    """The same passes into reused outputs: copy_ (the cast), div_, sub_."""
    for view, out in zip(views_of(x), outs):
        out.copy_(view).div_(127.5).sub_(1.0)
    return outs


def eager_2op_reuse(x: torch.Tensor, outs) -> list[torch.Tensor]:
    """The fastest bit-identical eager form: the division casts as it reads (uint8 / float -> float32)."""
    for view, out in zip(views_of(x), outs):
        torch.div(view, 127.5, out=out).sub_(1.0)
    return outs


def kernel_backends(device: str) -> list[str]:
    return [n for n, why in backends.availability("normalize_uint8_into", device).items() if not why and n != "torch"]


def providers(device: str) -> dict:
    """setting -> provider -> fn(x, outs); the first backend also runs in the alloc setting."""
    reuse = {"eager": eager_reuse, "eager-2op": eager_2op_reuse}
    alloc = {"eager": eager_alloc}
    names = kernel_backends(device)
    for name in names:
        reuse[name] = lambda x, outs, name=name: ops.normalize_uint8(x, num_views=NUM_VIEWS, backend=name, out=outs)
    if names:
        alloc[names[0]] = lambda x, outs: ops.normalize_uint8(x, num_views=NUM_VIEWS, backend=names[0])
    return {"reuse": reuse, "alloc": alloc}


def make_input(frames: int, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, 256, (3, frames, 512, 512), dtype=torch.uint8, device=device)


def _outputs(x):
    shape = (3, x.shape[1] // NUM_VIEWS, *x.shape[-2:])
    return [torch.empty(shape, dtype=torch.float32, device=x.device) for _ in range(NUM_VIEWS)]


def measure(frames: int, device: str, quick: bool) -> dict:
    """One input size: GB/s of every provider in both settings and of the copy, sampled round-robin."""
    x = make_input(frames, device)
    outs = _outputs(x)
    src = torch.empty(x.numel(), dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    fns = {"copy": lambda: dst.copy_(src)}
    for setting, table in providers(device).items():
        for name, fn in table.items():
            fns[f"{name}_{setting}"] = lambda fn=fn: fn(x, outs)
    seconds = interleaved_median_seconds(fns, repeat=5 if quick else 9, device=device, min_time=0.02)
    row = {"input_MB": x.numel() / 1e6, "elements": x.numel()}
    for key, s in seconds.items():
        row[f"{key}_GBps"] = (8 if key == "copy" else 5) * x.numel() / s / 1e9
    return row


def run_report(quick: bool = False, device: str | None = None) -> dict:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    table = providers(device)
    best = next(iter(kernel_backends(device)), None)
    results = {"device": device, "threads": torch.get_num_threads(), "kernel": best, "rows": []}
    for frames in QUICK_FRAMES if quick else FRAMES:
        results["rows"].append(measure(frames, device, quick))
    title = f"normalize_uint8 (num_views={NUM_VIEWS}, float32 out, {device}, {torch.get_num_threads()} threads)"
    for setting, names in table.items():
        header = ["input MB"] + [f"{n} GB/s" for n in names] + (["copy GB/s"] if setting == "reuse" else [])
        if best:
            header += [f"{best}/eager x"] + ([f"{best}/eager-2op x", f"{best}/copy x"] if setting == "reuse" else [])
        cells = []
        for row in results["rows"]:
            line = [f"{row['input_MB']:.1f}"] + [row[f"{n}_{setting}_GBps"] for n in names]
            if setting == "reuse":
                line.append(row["copy_GBps"])
            if best:
                kernel = row[f"{best}_{setting}_GBps"]
                line.append(kernel / row[f"eager_{setting}_GBps"])
                if setting == "reuse":
                    line += [kernel / row["eager-2op_reuse_GBps"], kernel / row["copy_GBps"]]
            cells.append(line)
        print(format_table(f"{title}, {setting}", header, cells))
    print("\n".join(f"  {line}" for line in LEGEND))
    if best:
        results["summary"] = summary(results["rows"], best)
    return results


def summary(rows: list[dict], best: str) -> dict:
    """The headline figures at the 25M-element input (and the copy fraction at the largest), each ratio
    like for like: reuse against reuse, alloc against alloc; "strongest eager" is the faster of the
    two eager forms."""
    target = min(rows, key=lambda r: abs(r["elements"] - TARGET_ELEMENTS))
    largest = rows[-1]
    kernel = target[f"{best}_reuse_GBps"]
    return {
        "provider": best,
        "input_MB": round(target["input_MB"], 1),
        "GBps_reuse": round(kernel, 2),
        "x_eager_both_reuse": round(kernel / target["eager_reuse_GBps"], 2),
        "x_strongest_eager_both_reuse": round(
            kernel / max(target["eager_reuse_GBps"], target["eager-2op_reuse_GBps"]), 2
        ),
        "x_eager_both_alloc": round(target[f"{best}_alloc_GBps"] / target["eager_alloc_GBps"], 2),
        "fraction_of_copy_reuse": round(kernel / target["copy_GBps"], 3),
        "fraction_of_copy_reuse_at_largest": round(largest[f"{best}_reuse_GBps"] / largest["copy_GBps"], 3),
    }


PYTEST_PROVIDERS = ["eager-reuse", "eager-2op-reuse", "eager-alloc", "cpp-reuse", "cpp-alloc", "triton-reuse",
                    "cuda-reuse", "copy"]


@pytest.mark.parametrize("frames", FRAMES)
@pytest.mark.parametrize("provider", PYTEST_PROVIDERS)
def test_normalize(benchmark, provider, frames):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = make_input(frames, device)
    outs = _outputs(x)
    name, _, setting = provider.rpartition("-")
    table = providers(device)
    if provider == "copy":
        src = torch.empty(x.numel(), dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        fn = lambda: dst.copy_(src)  # noqa: E731
    elif name in table[setting]:
        fn = lambda: table[setting][name](x, outs)  # noqa: E731
    else:
        pytest.skip(f"{provider} not available on {device}")
    benchmark.extra_info["bytes_counted"] = x.numel() * (8 if provider == "copy" else 5)

    def timed():
        fn()
        sync(device)

    benchmark(timed)


def plot(report: dict, out_dir: str) -> list[str]:
    """GB/s vs input size, one line per provider and setting (and the copy ceiling)."""
    rows = report["rows"]
    series = {k.removesuffix("_GBps").replace("_", " "): [r[k] for r in rows] for k in rows[0] if k.endswith("_GBps")}
    return line_plot(out_dir, "normalize.png", [r["input_MB"] for r in rows], series, xscale="log",
                     xlabel="input MB (uint8)", ylabel="GB/s (5 bytes per element; copy: 8)",
                     title=f"normalize_uint8 ({report['device']})")


if __name__ == "__main__":
    run_report(quick="--quick" in sys.argv)
