"""Triton kernel of ``latentfast::scatter_cotangents_into`` (layout: see latentfast.reference).

It replaces the CUDA C++ kernel so the wheel needs no nvcc and runs with whatever CUDA the user's
torch brings. One launch covers every (microbatch, branch) segment: the host builds a small table of
segment descriptors (source offset and strides, block shape, arena offset, first tile), copies it to
the device on the current stream, and each program handles one tile of ``TILE`` elements of one
segment, found by counting the segments whose first tile is <= its own (the table is short: one row
per microbatch and branch). Sources are addressed as element offsets from the lowest of the grads'
data pointers (every grad has one dtype, so the offsets are whole elements); when every segment is
contiguous the index math is one add, otherwise one division by D and one by N per element.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import launch
from ._rounding import cast_rounded

TILE = 4096
# A table row (int64 each): 0 source offset (elements from base), 1-3 source strides (rows, tokens,
# channels), 4 N, 5 D, 6 elements of one copy of the block, 7 arena offset of the first copy, 8 first
# tile. A last row holds the two scales' float64 bits.
FIELDS = 9


@triton.jit(do_not_specialize=["n_segments"])
def _scatter_cotangents_kernel(
    base_ptr,
    table_ptr,
    arena_ptr,
    n_segments,
    TWO_COPIES: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    SEGMENTS: tl.constexpr,
    TILE: tl.constexpr,
    FLOAT64: tl.constexpr,
):
    """arena[ARENA + e] = src[e] * s0 (and arena[ARENA + NUMEL + e] = src[e] * s1) for the tile's segment,
    e = the element index within the segment's [rows, N, D] block."""
    tile = tl.program_id(0).to(tl.int64)
    ids = tl.arange(0, SEGMENTS)
    firsts = tl.load(table_ptr + ids * 9 + 8, mask=ids < n_segments, other=2**62)
    seg = (tl.sum((firsts <= tile).to(tl.int64), axis=0) - 1).to(tl.int64)
    row = table_ptr + seg * 9
    s0 = tl.load(table_ptr + n_segments * 9).to(tl.float64, bitcast=True)
    s1 = tl.load(table_ptr + n_segments * 9 + 1).to(tl.float64, bitcast=True)
    numel = tl.load(row + 6)
    e = (tile - tl.load(row + 8)) * TILE + tl.arange(0, TILE).to(tl.int64)
    mask = e < numel
    if CONTIGUOUS:
        offsets = tl.load(row + 0) + e
    else:
        D = tl.load(row + 5)
        N = tl.load(row + 4)
        rest = e // D
        offsets = tl.load(row + 0) + (rest // N) * tl.load(row + 1) + (rest % N) * tl.load(row + 2) + (e % D) * tl.load(row + 3)
    out = arena_ptr + tl.load(row + 7) + e
    if FLOAT64:  # the product in float64, rounded to the arena's dtype through float32 (as torch does)
        v = tl.load(base_ptr + offsets, mask=mask, other=0.0).to(tl.float64)
        first = v * s0
        second = v * s1
        if arena_ptr.dtype.element_ty != tl.float64:
            first = first.to(tl.float32)
            second = second.to(tl.float32)
    else:
        v = tl.load(base_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        first = v * s0.to(tl.float32)
        second = v * s1.to(tl.float32)
    dtype = arena_ptr.dtype.element_ty
    if dtype != tl.float64 and dtype != tl.float32:
        first = cast_rounded(first, dtype)
        second = cast_rounded(second, dtype)
    tl.store(out, first.to(dtype), mask=mask)
    if TWO_COPIES:
        tl.store(out + numel, second.to(dtype), mask=mask)


def _table(grads, batch_sizes, copies: int):
    """(segment rows, base tensor, tiles, every segment contiguous)."""
    base = min(grads, key=lambda g: g.data_ptr())
    size = base.element_size()
    rows, offset, row0, tiles, contiguous = [], 0, 0, 0, True
    for batch in batch_sizes:
        for g in grads:
            numel = batch * g.shape[1] * g.shape[2]
            if numel:
                delta = g.data_ptr() - base.data_ptr()
                src = delta // size + row0 * g.stride(0)
                block = g[row0 : row0 + batch]
                contiguous = contiguous and block.is_contiguous()
                rows.append((src, *g.stride(), g.shape[1], g.shape[2], numel, offset, tiles))
                tiles += triton.cdiv(numel, TILE)
            offset += copies * numel
        row0 += batch
    return rows, base, tiles, contiguous


def scatter_cotangents_into(grads, batch_sizes, scales, arena) -> None:
    """One launch for every segment; the op's checks (shapes, sizes, overlap) ran before."""
    grads = [g if (g.data_ptr() % g.element_size()) == 0 else g.clone() for g in grads]  # whole-element offsets
    copies = len(scales)
    rows, base, tiles, contiguous = _table(grads, batch_sizes, copies)
    if tiles == 0:
        return
    bits = torch.tensor([float(scales[0]), float(scales[-1])], dtype=torch.float64).view(torch.int64).tolist()
    table = torch.tensor([*rows, (*bits, *[0] * (FIELDS - 2))], dtype=torch.int64).to(arena.device)
    launch(_scatter_cotangents_kernel, (tiles,), "arena", arena, base, table, arena, len(rows),
           TWO_COPIES=copies == 2, CONTIGUOUS=contiguous, SEGMENTS=triton.next_power_of_2(len(rows)), TILE=TILE,
           FLOAT64=grads[0].dtype == torch.float64)
