"""Triton kernel of latent sampling: ``out = mean + std * eps`` with the counter-based ``eps`` of
:mod:`latentfast.sampling` (Philox4x32-10 keyed by the item seed, Box-Muller in float32).

:func:`sample_latents_into` is the ``triton`` backend of the op ``latentfast::sample_latents_into``
(``latentfast.ops.sample_latents``; the C++ CPU kernel is ``csrc/cpu/sample_latents_kernel.cpp``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..sampling import check_sample_latents
from ._launch import TILE_ELEMENTS, launch
from ._rounding import cast_rounded

PHILOX_M0: tl.constexpr = 0xD2511F53
PHILOX_M1: tl.constexpr = 0xCD9E8D57
PHILOX_W0: tl.constexpr = 0x9E3779B9
PHILOX_W1: tl.constexpr = 0xBB67AE85
STREAM_LATENT_EPS: tl.constexpr = 0
# a program handles BLOCK_SIZE groups of four elements: one Philox call per group
BLOCK_SIZE = TILE_ELEMENTS // 4


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Random123's ``philox4x32_10`` on uint32 tensors: counter (c0..c3), key (k0, k1) -> four words."""
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, PHILOX_M0)
        lo0 = c0 * PHILOX_M0
        hi1 = tl.umulhi(c2, PHILOX_M1)
        lo1 = c2 * PHILOX_M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + PHILOX_W0  # the bump after the last round is never used
        k1 = k1 + PHILOX_W1
    return c0, c1, c2, c3


@triton.jit
def _group_words(seeds_ptr, b, q, mask):
    """The Philox words of group ``q`` of item ``b``: key = seeds[b] split in 32-bit halves,
    counter = (q_lo, q_hi, STREAM_LATENT_EPS, 0)."""
    seed = tl.load(seeds_ptr + b, mask=mask, other=0)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = (q & 0xFFFFFFFF).to(tl.uint32)
    c1 = (q >> 32).to(tl.uint32)
    zero = tl.zeros_like(c0)
    return philox4x32_10(c0, c1, zero + STREAM_LATENT_EPS, zero, k0, k1)


@triton.jit
def box_muller(a, b):
    """Two float32 standard normals from two uint32 words: u1 in (0, 1], u2 in [0, 1), both exact."""
    u1 = ((a >> 8) + 1).to(tl.float32) * 5.9604644775390625e-08
    u2 = (b >> 8).to(tl.float32) * 5.9604644775390625e-08
    r = tl.sqrt(-2.0 * tl.log(u1))
    t = u2 * 6.2831854820251465
    return r * tl.cos(t), r * tl.sin(t)


@triton.jit
def _sample_one(z, j, row_ok, b, mean_ptr, std_ptr, out_ptr, N, W, stride_mb, stride_mr, stride_mw,
                stride_sb, stride_sr, stride_sw, stride_ob, stride_or, stride_ow):
    """Element ``j`` (C-order index in item ``b``, viewed as [R, W]) of every lane: out = mean + std * z."""
    ok = row_ok & (j < N)
    r = j // W
    w = j % W
    m = tl.load(mean_ptr + b * stride_mb + r * stride_mr + w * stride_mw, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(std_ptr + b * stride_sb + r * stride_sr + w * stride_sw, mask=ok, other=0.0).to(tl.float32)
    y = m + s * z
    tl.store(out_ptr + b * stride_ob + r * stride_or + w * stride_ow, cast_rounded(y, out_ptr.dtype.element_ty),
             mask=ok)


# batch size, item shape, strides and pointers change from batch to batch: none is specialized
# (a new bucket shape must not compile the kernel again); only the dtypes select a compiled kernel.
@triton.jit(do_not_specialize=["mean_ptr", "std_ptr", "seeds_ptr", "out_ptr", "n_groups", "G", "N", "W",
                               "stride_mb", "stride_mr", "stride_mw", "stride_sb", "stride_sr", "stride_sw",
                               "stride_ob", "stride_or", "stride_ow"])
def _sample_latents_kernel(
    mean_ptr,
    std_ptr,
    seeds_ptr,
    out_ptr,
    n_groups,
    G,
    N,
    W,
    stride_mb,
    stride_mr,
    stride_mw,
    stride_sb,
    stride_sr,
    stride_sw,
    stride_ob,
    stride_or,
    stride_ow,
    BLOCK_SIZE: tl.constexpr,
):
    """out[b, j] = mean[b, j] + std[b, j] * eps(seeds[b], j)   (float32 math, one rounding to out's dtype).

    mean, std, out: [B, R, W] views of any strides, N = R * W elements per item, j = r * W + w.
    seeds: int64 [B] (uint64 Philox keys). Groups are (b, q), q < G = ceil(N / 4), n_groups = B * G;
    group q's Philox words (counter (q_lo, q_hi, 0, 0)) give the normals of elements 4q .. 4q+3.
    """
    g = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    row_ok = g < n_groups
    b = g // G
    q = g % G
    x0, x1, x2, x3 = _group_words(seeds_ptr, b, q, row_ok)
    z0, z1 = box_muller(x0, x1)
    z2, z3 = box_muller(x2, x3)
    j = q * 4
    _sample_one(z0, j, row_ok, b, mean_ptr, std_ptr, out_ptr, N, W, stride_mb, stride_mr, stride_mw,
                stride_sb, stride_sr, stride_sw, stride_ob, stride_or, stride_ow)
    _sample_one(z1, j + 1, row_ok, b, mean_ptr, std_ptr, out_ptr, N, W, stride_mb, stride_mr, stride_mw,
                stride_sb, stride_sr, stride_sw, stride_ob, stride_or, stride_ow)
    _sample_one(z2, j + 2, row_ok, b, mean_ptr, std_ptr, out_ptr, N, W, stride_mb, stride_mr, stride_mw,
                stride_sb, stride_sr, stride_sw, stride_ob, stride_or, stride_ow)
    _sample_one(z3, j + 3, row_ok, b, mean_ptr, std_ptr, out_ptr, N, W, stride_mb, stride_mr, stride_mw,
                stride_sb, stride_sr, stride_sw, stride_ob, stride_or, stride_ow)


@triton.jit(do_not_specialize=["seeds_ptr", "out_ptr", "n_groups", "G", "first_group"])
def _philox_words_kernel(seeds_ptr, out_ptr, n_groups, G, first_group, BLOCK_SIZE: tl.constexpr):
    """out[b, 4q + i] = word i of group first_group + q of item b (int64 holding uint32): the integer stream."""
    g = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    ok = g < n_groups
    x0, x1, x2, x3 = _group_words(seeds_ptr, g // G, first_group + g % G, ok)
    tl.store(out_ptr + g * 4, x0.to(tl.int64), mask=ok)
    tl.store(out_ptr + g * 4 + 1, x1.to(tl.int64), mask=ok)
    tl.store(out_ptr + g * 4 + 2, x2.to(tl.int64), mask=ok)
    tl.store(out_ptr + g * 4 + 3, x3.to(tl.int64), mask=ok)


def philox_words(item_seeds: torch.Tensor, n: int, *, first_group: int = 0) -> torch.Tensor:
    """int64 ``[B, 4 * ceil(n / 4)]``: the words the sampling kernel draws for ``n`` elements of each item
    from group ``first_group`` on (what :func:`latentfast.sampling.philox_words` computes; for tests and
    for matching other kernels)."""
    groups = (n + 3) // 4
    out = torch.empty(item_seeds.shape[0], 4 * groups, dtype=torch.int64, device=item_seeds.device)
    if out.numel():
        grid = (triton.cdiv(item_seeds.shape[0] * groups, BLOCK_SIZE),)
        launch(_philox_words_kernel, grid, "item_seeds", item_seeds, item_seeds.contiguous(), out,
               item_seeds.shape[0] * groups, groups, first_group, BLOCK_SIZE=BLOCK_SIZE)
    return out


def _as_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x [B, ...]`` as a ``[B, R, W]`` view (W the last dim), or None when its strides do not merge."""
    width = x.shape[-1] if x.ndim > 1 else 1
    try:
        return x.view(x.shape[0], -1, width)
    except RuntimeError:
        return None


def sample_latents_into(mean: torch.Tensor, std: torch.Tensor, item_seeds: torch.Tensor, out: torch.Tensor) -> None:
    """One launch for the whole batch. Inputs whose inner dims cannot be viewed as [R, W] are copied to
    contiguous first; an ``out`` of such a layout is written through a contiguous buffer."""
    check_sample_latents(mean, std, item_seeds, out)
    B = mean.shape[0]
    N = mean[0].numel() if B else 0
    if B == 0 or N == 0:
        return
    mean_rows = _as_rows(mean)
    mean_rows = _as_rows(mean.contiguous()) if mean_rows is None else mean_rows
    std_rows = _as_rows(std)
    std_rows = _as_rows(std.contiguous()) if std_rows is None else std_rows
    out_rows = _as_rows(out)
    target = out_rows if out_rows is not None else torch.empty(mean.shape, dtype=out.dtype, device=out.device)
    target_rows = _as_rows(target)
    seeds = item_seeds.to(mean.device).contiguous()
    groups = (N + 3) // 4
    grid = (triton.cdiv(B * groups, BLOCK_SIZE),)
    launch(_sample_latents_kernel, grid, "out", out, mean_rows, std_rows, seeds, target_rows, B * groups, groups,
           N, mean_rows.shape[-1], *mean_rows.stride(), *std_rows.stride(), *target_rows.stride(),
           BLOCK_SIZE=BLOCK_SIZE)
    if out_rows is None:
        out.copy_(target)
