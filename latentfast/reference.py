"""Pure-torch reference of every op: the fallback on any device and the oracle of every test.

Each function here implements the *kernel form* declared in :mod:`latentfast._ops` (same
name, same arguments), written for clarity rather than speed.
"""
from __future__ import annotations

import os

import torch

from .sampling import sample_latents_reference


def normalize_uint8_into(x: torch.Tensor, out: list[torch.Tensor]) -> None:
    """``out[v] = (x[..., v*F:(v+1)*F, :, :] / 127.5 - 1)`` in float32, rounded to ``out[v].dtype``.

    ``x``: uint8 ``[..., C, T, H, W]``; ``out``: ``len(out)`` views of ``[..., C, T/len(out), H, W]``.
    """
    frames = x.shape[-3] // len(out)
    for view, target in enumerate(out):
        part = x.narrow(-3, view * frames, frames)
        target.copy_(part.to(torch.float32).div_(127.5).sub_(1.0))


# ---- cache decode ----------------------------------------------------------------------------
def _row_views(data, row_offsets, widths, pitch, indices, channels, latent_h, max_width):
    """Every requested row as a strided ``[C, h, w_i]`` view of ``data``, all checked before any copy.

    Row ``i``'s line ``(c, y)`` starts at ``row_offsets[i] + (c*h + y) * pitch``; ``pitch == 0``
    means the ragged layout, where the line pitch is the row's own width.
    """
    n_rows = row_offsets.numel()
    views = []
    for position, i in enumerate(indices.tolist()):
        if not 0 <= i < n_rows:
            raise IndexError(f"indices[{position}] = {i} is out of range for {n_rows} rows")
        width = int(widths[i])
        if not 0 <= width <= max_width or (pitch and width > pitch):
            raise ValueError(f"row {i} has width {width}, outside [0, {min(max_width, pitch or max_width)}]")
        line_pitch = pitch or width
        start = int(row_offsets[i])
        extent = (channels * latent_h - 1) * line_pitch + width if channels * latent_h and width else 0
        if start < 0 or start + extent > data.numel():
            raise ValueError(f"row {i} spans [{start}, {start + extent}) outside the data's {data.numel()} elements")
        views.append(
            torch.as_strided(data, (channels, latent_h, width), (latent_h * line_pitch, line_pitch, 1), start)
        )
    return views


def gather_rows_into(data, row_offsets, widths, pitch: int, indices, white, out) -> None:
    """``out[b] = concat(row(indices[b]), white repeated to W)`` along the last axis, cast to out's dtype.

    ``data``: flat float16; ``out``: ``[B, C, h, W]``; ``white``: ``C*h`` float16 values ``[C, h, 1]``, or None
    when no row needs padding.
    """
    _, channels, latent_h, max_width = out.shape
    _pad_rows(_row_views(data, row_offsets, widths, pitch, indices, channels, latent_h, max_width), white, out)


def _pad_rows(views, white, out) -> None:
    """``out[b]`` = ``views[b]`` then the white column up to W (a narrower row without white: an error)."""
    _, channels, latent_h, max_width = out.shape
    if white is None:
        for b, row in enumerate(views):
            if row.shape[-1] != max_width:
                raise ValueError(
                    f"indices[{b}] (width {row.shape[-1]}) needs padding to W={max_width} but no white column was given"
                )
    for b, row in enumerate(views):
        width = row.shape[-1]
        out[b, :, :, :width] = row
        if width < max_width:
            out[b, :, :, width:] = white.reshape(channels, latent_h, 1)


def gather_rows_multi_into(data, row_sources, row_offsets, widths, pitch: int, indices, white, out) -> None:
    """:func:`gather_rows_into` with row ``i`` read from ``data[row_sources[i]]`` (its ``row_offsets[i]``
    counting that source's elements): one batch over several shards."""
    n_rows = row_offsets.numel()
    for position, i in enumerate(indices.tolist()):  # every row checked before any copy
        if not 0 <= i < n_rows:
            raise IndexError(f"indices[{position}] = {i} is out of range for {n_rows} rows")
        if not 0 <= int(row_sources[i]) < len(data):
            raise ValueError(f"row {i} names source {int(row_sources[i])}, outside the {len(data)} data tensors")
    _, channels, latent_h, max_width = out.shape
    views = []
    for i in indices.tolist():
        one = torch.tensor([i], dtype=torch.int64)
        views += _row_views(data[int(row_sources[i])], row_offsets, widths, pitch, one, channels, latent_h, max_width)
    _pad_rows(views, white, out)


def gather_rows_packed_into(data, row_offsets, widths, pitch: int, indices, channels: int, latent_h: int, out) -> None:
    """``out[:sum(C*h*w_i)]`` = the requested rows ``[C, h, w_i]`` flattened and concatenated in order."""
    views = _row_views(data, row_offsets, widths, pitch, indices, channels, latent_h, torch.iinfo(torch.int32).max)
    needed = sum(row.numel() for row in views)
    if out.numel() < needed:
        raise ValueError(f"out holds {out.numel()} elements, the rows need {needed}")
    start = 0
    for row in views:
        out[start : start + row.numel()] = row.reshape(-1)
        start += row.numel()


def check_expand_rows(packed, packed_offsets, widths, white, out) -> None:
    """Refuse, on the host, rows :func:`expand_rows_into` cannot serve: a width outside ``[0, W]``, a row
    not inside ``packed``, or a row narrower than W without a white column (shared with the Triton
    kernel's CPU path, which has no bounds checks of its own)."""
    _, channels, latent_h, max_width = out.shape
    lines = channels * latent_h
    for b, (start, width) in enumerate(zip(packed_offsets.tolist(), widths.tolist())):
        if not 0 <= width <= max_width or start < 0 or start + lines * width > packed.numel():
            raise ValueError(
                f"row {b} (offset {start}, width {width}) needs 0 <= width <= W={max_width} and to lie inside "
                f"packed's {packed.numel()} elements"
            )
        if width < max_width and white is None:
            raise ValueError(f"row {b} (width {width}) needs padding to W={max_width} but no white column was given")


def expand_rows_into(packed, packed_offsets, widths, white, out) -> None:
    """``out[b, c, y, x] = packed[packed_offsets[b] + (c*h + y)*widths[b] + x]`` for ``x < widths[b]``,
    else ``white[c*h + y]``; cast to out's dtype. ``out``: ``[B, C, h, W]``; ``white`` may be None
    only when every row is W wide."""
    check_expand_rows(packed, packed_offsets, widths, white, out)
    _, channels, latent_h, max_width = out.shape
    for b, (start, width) in enumerate(zip(packed_offsets.tolist(), widths.tolist())):
        row = packed[start : start + channels * latent_h * width].reshape(channels, latent_h, width)
        out[b, :, :, :width] = row
        if width < max_width:
            out[b, :, :, width:] = white.reshape(channels, latent_h, 1)


# ---- file reads -----------------------------------------------------------------------------
def read_spans_into(fd: int, offsets, lengths, threads: int, out) -> None:
    """Bytes ``[offsets[k], offsets[k] + lengths[k])`` of the open file ``fd``, for each k, back to back
    into the uint8 tensor ``out``. One span at a time (``threads`` is the compiled kernel's concern)."""
    spans = list(zip(offsets.tolist(), lengths.tolist()))
    for k, (offset, length) in enumerate(spans):
        if offset < 0 or length < 0:
            raise ValueError(f"span {k} = (offset {offset}, length {length}) is not a byte range of a file")
    total = sum(length for _, length in spans)
    if total > out.numel():
        raise ValueError(f"out holds {out.numel()} bytes, the spans need {total}")
    view = memoryview(out.numpy()).cast("B") if total else None
    start = 0
    for k, (offset, length) in enumerate(spans):
        done = 0
        while done < length:
            try:
                got = os.preadv(fd, [view[start + done : start + length]], offset + done)
            except OSError as exc:  # as the compiled kernel reports it
                raise RuntimeError(f"pread of span {k} failed: {exc.strerror}") from None
            if got == 0:
                raise ValueError(f"span {k} = [{offset}, {offset + length}) runs past the end of the file")
            done += got
        start += length


# ---- replay ------------------------------------------------------------------------------------
def scatter_cotangents_into(
    grads: list[torch.Tensor], batch_sizes: list[int], scales: list[float], arena: torch.Tensor
) -> None:
    """Split per-branch leaf gradients into per-microbatch blocks, each stored once per scale in ``arena``.

    ``grads[k]``: ``[b_local, N_k, D_k]`` (any strides, one dtype); ``batch_sizes``: the microbatch
    sizes, summing to ``b_local``; ``scales``: one or two factors; ``arena``: contiguous 1-D of
    ``len(scales) * b_local * sum_k N_k * D_k`` elements, of any floating dtype. Segment ``(m, k)``
    (microbatch-major, branch-minor) holds ``grads[k][rows of m] * scales[c]`` for each ``c`` in
    turn, computed in float32 (float64 for float64 gradients) and rounded to the arena's dtype.
    """
    opmath = torch.float64 if grads[0].dtype == torch.float64 else torch.float32
    offset, row = 0, 0
    for size in batch_sizes:
        for grad in grads:
            block = grad[row : row + size].to(opmath)
            count = block.numel()
            for scale in scales:
                torch.mul(block, scale, out=arena[offset : offset + count].view_as(block))
                offset += count
        row += size


# ---- latent sampling -------------------------------------------------------------------------
def sample_latents_into(mean, std, item_seeds, out) -> None:
    """``out[b] = mean[b] + std[b] * eps(item_seeds[b], element)`` in float32, rounded once to out's dtype:
    :func:`latentfast.sampling.sample_latents_reference` (which states ``eps`` bit for bit)."""
    sample_latents_reference(mean, std, item_seeds, out=out)
