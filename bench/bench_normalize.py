"""Fused uint8 -> [-1, 1] normalize (+ view split): the specification's eager path vs latentfast.

Effective bandwidth = bytes read (uint8 input) + bytes written (outputs). The copy row is a plain
``dst.copy_(src)`` of a float32 buffer of the output's size: what this machine's memory system
moves in the same run, the ceiling for a streaming kernel.

    pytest bench/bench_normalize.py --benchmark-only      # pytest-benchmark tables
    python bench/bench_normalize.py [--quick]             # side-by-side ratios
"""
from __future__ import annotations

import sys

import pytest
import torch

from latentfast import backends, ops

from latentfast.bench.common import format_table, line_plot, median_seconds, sync

NUM_VIEWS = 2
# input frames of [3, T, 512, 512] uint8: 1.5 MB ... 100 MB (T=32 is the 25M-element target case)
FRAMES = (2, 8, 32, 128)
QUICK_FRAMES = (2, 32)


def spec_eager(x: torch.Tensor, num_views: int) -> list[torch.Tensor]:
    """The specification's path: one narrow + to(float32) + div_ + sub_ per view."""
    frames = x.shape[-3] // num_views
    return [x.narrow(-3, v * frames, frames).to(torch.float32).div_(127.5).sub_(1.0) for v in range(num_views)]


def make_input(frames: int, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, 256, (3, frames, 512, 512), dtype=torch.uint8, device=device)


def providers(device: str) -> dict:
    op = "normalize_uint8_into"
    available = [name for name, why in backends.availability(op, device).items() if not why and name != "torch"]
    table = {"eager": lambda x, outs: spec_eager(x, NUM_VIEWS)}
    for name in available:
        table[name] = lambda x, outs, name=name: ops.normalize_uint8(x, num_views=NUM_VIEWS, backend=name, out=outs)
    # the same kernel allocating fresh outputs per call, as the eager path does: on a CPU the
    # first-touch page faults of a fresh 100 MB buffer can cost more than the kernel itself
    first = next((n for n in ("cuda", "cpp", "triton") if n in available), None)
    if first:
        table[f"{first}-alloc"] = lambda x, outs: ops.normalize_uint8(x, num_views=NUM_VIEWS, backend=first)
    return table


def _outputs(x):
    shape = (3, x.shape[1] // NUM_VIEWS, *x.shape[-2:])
    return [torch.empty(shape, dtype=torch.float32, device=x.device) for _ in range(NUM_VIEWS)]


def run_report(quick: bool = False, device: str | None = None) -> dict:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    frames_list = QUICK_FRAMES if quick else FRAMES
    results = {"device": device, "threads": torch.get_num_threads(), "rows": []}
    table_rows = []
    names = list(providers(device))
    for frames in frames_list:
        x = make_input(frames, device)
        outs = _outputs(x)
        moved = x.numel() * (1 + 4)  # read uint8, write float32
        row = {"input_MB": x.numel() / 1e6, "elements": x.numel()}
        for name, fn in providers(device).items():
            seconds = median_seconds(lambda: fn(x, outs), repeat=5 if quick else 9, device=device, min_time=0.02)
            row[f"{name}_GBps"] = moved / seconds / 1e9
        src = torch.empty(x.numel(), dtype=torch.float32, device=device).uniform_()
        dst = torch.empty_like(src)
        seconds = median_seconds(lambda: dst.copy_(src), repeat=5 if quick else 9, device=device, min_time=0.02)
        row["copy_GBps"] = 2 * src.numel() * 4 / seconds / 1e9
        results["rows"].append(row)
        best = max((n for n in names if n != "eager" and not n.endswith("-alloc")), key=lambda n: row[f"{n}_GBps"], default="eager")
        table_rows.append(
            [f"{row['input_MB']:.1f}"]
            + [row[f"{n}_GBps"] for n in names]
            + [row["copy_GBps"], row[f"{best}_GBps"] / row["eager_GBps"], row[f"{best}_GBps"] / row["copy_GBps"]]
        )
        results["best_provider"] = best
    target = max(results["rows"], key=lambda r: -abs(r["elements"] - 25_165_824))
    best = results["best_provider"]
    results["summary"] = {
        "provider": best,
        "GBps_at_25M_elements": round(target[f"{best}_GBps"], 2),
        "speedup_vs_eager_at_25M_elements": round(target[f"{best}_GBps"] / target["eager_GBps"], 2),
        "fraction_of_copy_at_25M_elements": round(target[f"{best}_GBps"] / target["copy_GBps"], 3),
        "alloc_speedup_vs_eager_at_25M_elements": round(
            max((target[k] for k in target if k.endswith("-alloc_GBps")), default=float("nan")) / target["eager_GBps"], 2
        ),
        "fraction_of_copy_at_largest": round(results["rows"][-1][f"{best}_GBps"] / results["rows"][-1]["copy_GBps"], 3),
    }
    header = ["input MB"] + [f"{n} GB/s" for n in names] + ["copy GB/s", "best/eager", "best/copy"]
    print(format_table(f"normalize_uint8 (num_views={NUM_VIEWS}, float32 out, {device}, {torch.get_num_threads()} threads)", header, table_rows))
    return results


@pytest.mark.parametrize("frames", FRAMES)
@pytest.mark.parametrize("provider", ["eager", "cpp", "cpp-alloc", "triton", "cuda", "cuda-alloc", "copy"])
def test_normalize(benchmark, provider, frames):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    table = providers(device)
    x = make_input(frames, device)
    outs = _outputs(x)
    if provider == "copy":
        src = torch.empty(x.numel(), dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        fn = lambda: dst.copy_(src)  # noqa: E731
    elif provider in table:
        fn = lambda: table[provider](x, outs)  # noqa: E731
    else:
        pytest.skip(f"{provider} not available on {device}")
    benchmark.extra_info["bytes_moved"] = x.numel() * 5

    def timed():
        fn()
        sync(device)

    benchmark(timed)



def plot(report: dict, out_dir: str) -> list[str]:
    """GB/s vs input size, one line per provider (and the copy ceiling)."""
    rows = report["rows"]
    series = {k.removesuffix("_GBps"): [r[k] for r in rows] for k in rows[0] if k.endswith("_GBps")}
    return line_plot(out_dir, "normalize.png", [r["input_MB"] for r in rows], series, xscale="log",
                     xlabel="input MB (uint8)", ylabel="GB/s (read + written)", title=f"normalize_uint8 ({report['device']})")


if __name__ == "__main__":
    run_report(quick="--quick" in sys.argv)
