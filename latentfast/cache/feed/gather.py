"""The one batch read path: ``read_batch(cache, indices)`` resolves the batch's span table once and copies it, on the CPU or a CUDA device.

CPU target: one compiled gather (``latentfast::gather_rows_into``) copies each requested row's real
columns from the memmap straight into the output, pads with the white column and casts, on several
threads with the GIL released. A batch of small rows costs about as much in fixed per-call work as
in copying, so that path is kept short: the kernel, which checks every index before copying
anyway, is the one that validates a plain int64 vector (see :func:`~latentfast.cache.store.layout.resolve`).
A batch far larger than the CPU caches (a padded text field of a batch of records: hundreds of MiB)
is written into reused buffers with streaming stores, padding included, and a 2-byte field's pad
value is padded by the gather itself; the gather takes its threads only where they have measured faster than its caller
alone (a busy host preempts pool workers mid-batch). Into reused buffers (``out=``) such a batch
costs about a memcpy of its useful bytes (``bench/RESULTS.md``). A fresh batch (no ``out=``) of 4 MiB or
more is written into a recycled huge-page map (:func:`~latentfast.cache.feed.buffers.fresh_host`), not
into pages the kernel has to fault in and zero for every batch.

CUDA target (:mod:`latentfast.cache.feed.device`): the same rows' real columns only are gathered
back to back into a slot of a pinned ring buffer, copied to the device on a side stream (bytes over
PCIe = useful bytes), and one device kernel (``latentfast::expand_rows_into``) pads and casts.

Shaped caches (image buckets, video) take the same two targets: a batch of one item shape is a
ragged gather of one line per item, reshaped to ``[B, *shape]``. Both targets take the cold-read
path of :mod:`latentfast.cache.feed.coldread` before copying, and a cache opened with
``verify_rows`` has the batch's checksum blocks checked first. Each step reads the span table;
none goes back to the cache for geometry.
"""
from __future__ import annotations

import functools
import time

import numpy as np
import torch

from ...checks import FLOAT_DTYPES
from ...devices import as_device
from ...errors import AbsentValueError, DeviceUnavailableError, InvalidArgumentError
from ..store import layout
from ..store.layout import ELEMENT_BYTES
from ... import ops, sampling
from . import coldread, device as device_path
from .buffers import fresh_host, take
from .readspec import SPEC_OPTIONS, ReadSpec

_CPU = torch.device("cpu")


def read_batch(cache, indices, spec: ReadSpec | None = None, *, out=None, return_keys: bool = False, **options):
    """Rows ``indices`` of ``cache`` (a :class:`~latentfast.cache.LatentCache`, read through its
    :class:`~latentfast.cache.store.layout.Items`) as one batch.

    Args:
        indices: ints (sequence, numpy array or tensor); duplicates and any order allowed; each must
            be in ``[0, len(cache))`` (else IndexError naming it).
        device: where the batch lands, read with :func:`latentfast.devices.as_device` ("cpu",
            "cuda" = the current CUDA device, "cuda:1", an int, a torch.device). Default "cpu": a
            host batch, which a DataLoader pins and :class:`~latentfast.cache.DevicePrefetcher`
            moves; pass a CUDA device to gather into pinned memory and expand on the device.
        dtype: float16, bfloat16 or float32; default: the cache's own (``cache.dtype``: float16, or what
            a shaped cache's records stored).
        width: W of the batch (an int), at least the widest requested row (default: exactly that);
            line caches only.
        spec: a :class:`~latentfast.cache.ReadSpec` holding every option below but ``out`` and
            ``return_keys`` (instead of them as keywords; the keywords build one).
        out: where the batch is written instead of fresh tensors: a preallocated contiguous tensor on
            ``device`` (the latent-only batch: ``[B, C, h, W]``; a shaped cache's: ``[B, *shape]``), a
            dict ``{field: tensor}`` of a records batch's exact outputs (fields it lacks are allocated),
            or a :class:`~latentfast.cache.BatchBuffers`, whose reused buffers every path fills (fields,
            pad, packed, sample, flip): the batch's tensors are then views of them, valid until the
            same buffers are given to the next read.
        cold: ``"auto"`` (default) reads a batch whose pages are not in the page cache with parallel
            I/O before copying it, and stops checking once batches keep being found in memory
            (see :mod:`latentfast.cache.feed.coldread`); ``True`` always asks for the pages first (a
            cache known to be far larger than RAM); ``False`` never (pages fault in as touched).
        return_keys: also return each item's key (``cache.keys``), a list of B strings, as a third
            element: what a trainer joins captions or conditions on.

        fields: names of the cache's record fields (see ``cache.fields``) to read: the batch is then a
            dict (see below).
        pad: ``{field: value}``: these fields' items may differ in their first dimension; each is
            padded with ``value`` to the batch's largest (or ``pad_to``). A field not named here
            must have one shape across the batch. The latent is padded by its layout (``width``).
        pad_to: the first dimension padded fields are padded to: an int, or ``{field: int}``, each at most
            :data:`~latentfast.cache.store.layout.MAX_PAD_TO` (2**20).
        packed: fields whose items may differ in their first dimension, returned back to back
            (``[sum L_i, *rest]``, no padding written: what varlen attention takes, with
            ``cu_seqlens`` the cumulative sum of ``<field>_shape[:, 0]``).
        sample: return ``latent + latent_std * eps`` in the ``latent`` entry (a cache built with
            ``DiffusersVAE(sample="store")``), one :func:`latentfast.ops.sample_latents` call per batch
            on the batch's device; ``eps`` depends only on ``(seed, epoch, the item's key)``
            (:mod:`latentfast.sampling`), never on the batch, the worker or where a run resumed. The
            batch's latents must have one shape (no padding to draw over).
        flip: a probability: each item's ``latent`` entry is its ``latent_flipped`` (a cache built
            with ``flip=True``) with this probability, drawn from the same item seed (its own stream);
            the batch gets a ``flipped`` bool ``[B]`` entry. With ``sample`` the flipped items draw
            around ``latent_flipped`` with ``latent_flipped_std``. Where ``latent_flipped`` is optional
            (an import of a trainer folder that flips some subsets only), an item without one is never
            flipped: the draw is made among the items that have one.
        seed, epoch: the draws' run seed (an int, required with ``sample`` / ``flip``) and epoch (>= 0).

    Returns:
        With ``fields``: ``{field: [B, *shape] tensor, "<field>_shape": int64 [B, ndim] (the true
        shapes, on the CPU)}``; the latent in ``dtype``, every other field in its stored dtype,
        bit for bit. An optional field (one some items lack) adds ``"<field>_present"``, bool ``[B]``
        on the CPU; an item without a value has a zero shape and reads as zeros (its pad value where
        padded). A draw that needs a value an item lacks (``latent_std`` with ``sample``) raises
        :class:`~latentfast.errors.AbsentValueError` naming the item's key and the field. Without, line caches: ``(latents [B, C, h, W] of dtype on device, widths [B] int32 on the CPU)``;
        columns from a row's width up to W hold the cache's white column. Shaped caches:
        ``(latents [B, *shape], shapes [B, ndim] int64 on the CPU)``; items of different shapes
        raise ``InvalidArgumentError`` naming them.
    """
    if spec is None:
        spec = _spec_of(options) if options else _DEFAULT_SPEC
    elif options:
        raise InvalidArgumentError(f"read_batch takes a ReadSpec or its options as keywords, not both: got a spec and {sorted(options)}")
    device = spec.device
    on_cpu = device.__class__ is str and device == "cpu"  # the default passes as is, cheaply
    if not on_cpu:
        device = as_device(device)
        on_cpu = device.type == "cpu"
    # the cache as plain attributes, so nothing below calls back into the reader; an object that only
    # presents a cache's attributes (a wrapper) is read through Items made from it for this call
    items = getattr(cache, "__dict__", {}).get("items") or layout.Items(cache, source=cache.gather_source)
    dtype = items.dtype if spec.dtype is None else spec.dtype
    if spec.records:
        if isinstance(out, torch.Tensor):
            raise InvalidArgumentError("a batch of records takes out= as a BatchBuffers or a dict {field: tensor}, not one tensor")
        if spec.draws:
            if spec.width is not None:
                raise InvalidArgumentError("sample= and flip= read a dict of records: they take no width=")
            return _read_drawn(cache, items, indices, spec, on_cpu, device, dtype, out)
        if spec.fields is None:
            raise InvalidArgumentError("pad=, pad_to= and packed= need fields=")
        return _read_records(cache, items, indices, spec, spec.fields, on_cpu, device, dtype, out)
    given = out if isinstance(out, torch.Tensor) else None  # (a tensor is checked in resolve)
    table = layout.resolve(items, indices, width=spec.width, clip=on_cpu and not items.verify_rows and items.remote is None,
                           out=given, dtype=dtype, device=_CPU if on_cpu else device)
    if table.shape is not None:
        batch = _shaped_batch(table, device, dtype, given, spec.backend, spec.cold, out, "latent")
    else:
        if dtype not in FLOAT_DTYPES:
            raise InvalidArgumentError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
        if given is None and out is not None:
            given = take(out, "latent", (table.index.numel(), table.channels, table.latent_h, table.width), dtype, device)
        batch = _copy(table, on_cpu, device, dtype, given, spec.backend, spec.cold), torch.from_numpy(table.widths)
    if return_keys:
        layout.recheck(table)  # an unchecked index must not pick a key from the end of the list
        return (*batch, _batch_keys(cache, table.index_np))
    return batch


def _batch_keys(cache, index_np) -> list[str]:
    """The keys of a batch's items: looked up in the cache's key table (``keys_of``), not its whole list."""
    if hasattr(cache, "keys_of"):
        return cache.keys_of(index_np)
    keys = cache.keys  # (a cache-like object of the caller's own)
    return [keys[i] for i in index_np.tolist()]


_DEFAULT_SPEC = ReadSpec()


def _spec_of(options: dict) -> ReadSpec:
    unknown = sorted(set(options) - SPEC_OPTIONS)
    if unknown:
        raise TypeError(f"read_batch() got an unexpected keyword argument {unknown[0]!r}")
    return ReadSpec(**options)


def _read_records(cache, items, indices, spec, names, on_cpu, device, dtype, out, suffix="") -> dict:
    """A batch of records: each field's span table resolved once for the batch, then one gather per
    field, into ``out``'s buffers (named ``<field><suffix>``) where it has them."""
    field_items = getattr(cache, "__dict__", {}).get("field_items") or {}
    pad, pad_to, packed = (spec.pad, spec.pad_to, spec.packed) if not suffix else (None, None, ())
    batches = layout.resolve_fields(items, field_items, indices, names, pad, pad_to, width=None if suffix else spec.width,
                                    dtype=dtype, device=_CPU if on_cpu else device, packed=packed)
    result = {}
    for name, batch in batches.items():
        buffer = name + suffix
        if isinstance(batch, layout.SpanTable):  # the latent
            if batch.shape is not None:
                result[name], shapes = _shaped_batch(batch, device, dtype, None, spec.backend, spec.cold, out, buffer)
            else:
                if dtype not in FLOAT_DTYPES:
                    raise InvalidArgumentError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
                B = len(batch.widths)
                target = None if out is None else take(out, buffer, (B, batch.channels, batch.latent_h, batch.width), dtype, device)
                result[name] = _copy(batch, on_cpu, device, dtype, target, spec.backend, spec.cold)
                shapes = torch.tensor([[batch.channels, batch.latent_h, 0]], dtype=torch.int64).repeat(B, 1)
                shapes[:, 2] = torch.from_numpy(batch.widths)
        else:
            result[name] = _field_values(batch, on_cpu, device, spec, out, buffer)
            shapes = torch.from_numpy(batch.shapes)
            if batch.present is not None:
                result[name + "_present"] = torch.from_numpy(batch.present.copy())
        result[name + "_shape"] = shapes
    return result


def _read_drawn(cache, items, indices, spec, on_cpu, device, dtype, out) -> dict:
    """A batch of records whose ``latent`` entry is drawn: a flipped variant picked per item, a sample
    of each item's latent distribution, or both (see :func:`read_batch`)."""
    sample, flip, seed = spec.sample, spec.flip, spec.seed
    if sample is not True and sample is not False:
        raise InvalidArgumentError(f"sample must be True or False, got {sample!r}")
    names = list(spec.names)
    if "latent" not in names:
        raise InvalidArgumentError(f"sample= and flip= draw the 'latent' entry: fields must include 'latent', got {names!r}")
    if seed is None:
        raise InvalidArgumentError("sample= and flip= need seed= (an int: the run's seed; with epoch= it keys every draw)")
    have = getattr(cache, "__dict__", {}).get("field_items") or {}
    need = (["latent_std"] if sample else []) + (["latent_flipped"] if flip is not None else [])
    need += ["latent_flipped_std"] if sample and flip is not None else []
    for name in need:
        if name not in have:
            how = "DiffusersVAE(vae, sample='store')" if name.endswith("_std") else "build_image_cache(..., flip=True)"
            raise InvalidArgumentError(f"{'sample=True' if name.endswith('_std') else 'flip='} needs the field {name!r}, which "
                                       f"this cache {getattr(cache, 'cache_dir', '')} lacks (fields: {sorted(['latent', *have])}); "
                                       f"build it with {how}")
    index = layout.as_row_indices(indices, len(cache))
    index_np = index.numpy()
    seeds = sampling.item_seeds(_batch_keys(cache, index_np), seed, spec.epoch)
    flipped = sampling.flip_draws(seeds, flip) if flip is not None else torch.zeros(len(index_np), dtype=torch.bool)
    if flip is not None and have["latent_flipped"].present is not None:  # only items that have a flipped latent flip
        flipped &= torch.from_numpy(have["latent_flipped"].present[index_np])
    for name in need:  # a value the draw reads must be there (the flipped items' variants, the others' latent_std)
        present = have[name].present
        reads = flipped.numpy() if name.startswith("latent_flipped") else ~flipped.numpy()
        lacking = [] if present is None else np.flatnonzero(reads & ~present[index_np])
        if len(lacking):
            at = int(lacking[0])
            raise AbsentValueError(f"{'sample=True' if name.endswith('_std') else 'flip='} reads field {name!r} of indices[{at}] = "
                                   f"{int(index_np[at])} (key {_batch_keys(cache, index_np[at:at + 1])[0]!r}), which that item lacks")
    extra = [n for n in ("latent_std",) if sample and n not in names]
    batch = _read_records(cache, items, index, spec, names + extra, on_cpu, device, dtype, out)
    latent = batch["latent"]
    if flipped.any():  # the flipped items' variants, read for them only, put in their rows
        rows = flipped.nonzero().reshape(-1)
        mirror = _read_records(cache, items, index[rows], spec, need[1:] if sample else need, on_cpu, device, dtype, out,
                               suffix=".mirror")
        _check_mirror_shapes(mirror, batch["latent_shape"][rows], rows, index_np, sample)
        at = rows.to(latent.device)
        latent[at] = mirror["latent_flipped"].to(latent.dtype)
        if sample:
            batch["latent_std"][at] = mirror["latent_flipped_std"].to(batch["latent_std"].dtype)
    if sample:
        std, shapes = batch["latent_std"], batch["latent_shape"]
        if len(shapes) and (not torch.equal(shapes, batch["latent_std_shape"]) or bool((shapes != shapes[0]).any())
                            or list(shapes[0]) != list(latent.shape[1:])):
            raise InvalidArgumentError(f"sample=True draws over each item's own shape: the batch's latents must have one shape, "
                                       f"equal to latent_std's, got latent shapes {shapes.unique(dim=0).tolist()} in a batch of "
                                       f"{list(latent.shape)} (a line cache's rows of several widths cannot be sampled in one batch)")
        drawn = None if out is None else take(out, "latent.sample", latent.shape, latent.dtype, latent.device)
        batch["latent"] = ops.sample_latents(latent, std, seeds.to(latent.device), out=drawn, backend=spec.backend)  # (out may not alias mean)
        if "latent_std" in extra:
            del batch["latent_std"], batch["latent_std_shape"]
    if flip is not None:
        batch["flipped"] = flipped
    return batch


def _check_mirror_shapes(mirror: dict, latent_shapes: torch.Tensor, rows: torch.Tensor, index_np: np.ndarray, sample: bool) -> None:
    """A flipped latent (and its std) put in its latent's place must have the latent's shape, not broadcast
    into it (a cache written before the writer checked this)."""
    pairs = [("latent_flipped", "its latent", latent_shapes)]
    pairs += [("latent_flipped_std", "its latent_flipped", mirror["latent_flipped_shape"])] if sample else []
    for name, partner, want in pairs:
        bad = (mirror[name + "_shape"] != want).any(dim=1).nonzero().reshape(-1)
        if len(bad):
            b = int(rows[bad[0]])
            raise InvalidArgumentError(f"flip=: field {name!r} of indices[{b}] = {int(index_np[b])} has shape "
                                       f"{mirror[name + '_shape'][bad[0]].tolist()}, but {partner} has {want[bad[0]].tolist()} "
                                       f"(a cache written before the writer checked this: rebuild it)")


def _field_values(batch, on_cpu: bool, device, spec, out, name) -> torch.Tensor:
    """One field's batch: its values gathered as 2-byte units by the same compiled gather, viewed in their
    own dtype as ``[B, *shape]``, the padding past each item's first dimension filled with ``batch.pad``."""
    table, B = batch.table, batch.table.index.numel()
    if batch.packed:
        return _field_packed(batch, on_cpu, device, spec, out, name)
    nbytes = int(np.prod(batch.shape, dtype=np.int64)) * torch.empty(0, dtype=batch.dtype).element_size()
    if B == 0 or nbytes == 0:
        return torch.empty((B, *batch.shape), dtype=batch.dtype, device=device)
    final = None if out is None else take(out, name, (B, *batch.shape), batch.dtype, device)
    whole_units = nbytes % ELEMENT_BYTES == 0
    # a 2-byte value pads in the gather itself (its bits are one unit, the kernel's white column):
    # no second pass over the batch; other dtypes are padded with zeros, then filled below
    unit = _pad_unit(batch.dtype, batch.pad) if batch.pad is not None and batch.pad != 0 else None
    pad_in_gather = unit is not None
    if pad_in_gather:
        table.white = unit
    target = None  # the gather's [B, 1, 1, units] output: the final tensor's bytes, when they are whole units
    if final is not None:
        target = (_as_units(final, B, table.width) if whole_units
                  else take(out, name + ".units", (B, 1, 1, table.width), torch.float16, device))
    units = _copy(table, on_cpu, device, torch.float16, target, spec.backend, spec.cold)
    raw = units.view(B, -1).view(torch.uint8)
    if raw.shape[1] != nbytes:  # a 1-byte dtype with an odd count: drop the unit's spare byte
        raw = raw[:, :nbytes].contiguous() if final is None else final.view(B, -1).view(torch.uint8).copy_(raw[:, :nbytes])
    values = raw.view(batch.dtype).view(B, *batch.shape)
    if batch.pad is not None and batch.pad != 0 and batch.shape[0] and not pad_in_gather:
        lengths = torch.from_numpy(batch.shapes[:, 0]).to(values.device)
        tail = torch.arange(batch.shape[0], device=values.device)[None, :] >= lengths[:, None]
        values.view(B, batch.shape[0], -1).masked_fill_(tail[:, :, None], batch.pad)
    return values


@functools.lru_cache(maxsize=64)
def _pad_unit(dtype: torch.dtype, value) -> torch.Tensor | None:
    """A 2-byte pad value's bits as the gather's float16 ``[1, 1, 1]`` white column (one tensor per value:
    the CUDA path keeps a device copy per white column it is given); None for other dtypes, and for bits
    that read as a float16 NaN (a gather that pads through float32, without AVX2, would not keep them)."""
    if dtype.itemsize != ELEMENT_BYTES:
        return None
    unit = torch.tensor([value], dtype=dtype).view(torch.float16)
    return None if bool(unit.isnan()) else unit.view(1, 1, 1)


def _field_packed(batch, on_cpu: bool, device, spec, out, name) -> torch.Tensor:
    """A packed field's batch: the items' values back to back, ``[sum L_i, *rest]``, by one compiled
    packed gather (on the CPU; a CUDA batch is gathered into pinned memory and copied)."""
    table = batch.table
    units = int(table.widths.sum(dtype=np.int64))
    host = take(out, name if on_cpu else name + ".host", batch.shape, batch.dtype, _CPU, pin=not on_cpu)
    host = host.view(-1).view(torch.uint8).view(torch.float16)  # (packed values are whole 2-byte units)
    if units:
        with layout.holding_items(table.cache, table.index_np):  # (a cache in object storage: fetched, held)
            _before_copy(table, spec.cold)
            data, row_offsets, widths, pitch = table.source
            if isinstance(data, torch.Tensor):
                torch.ops.latentfast.gather_rows_packed_into.default(data, row_offsets, widths, pitch, table.rows, 1, 1, host,
                                                                     spec.backend)
            else:  # a sharded cache: the one multi-source gather, padded to the longest, then the real units kept
                lengths = torch.from_numpy(np.ascontiguousarray(table.widths))
                padded = take(out, name + ".staging", (len(lengths), 1, 1, int(lengths.max())), torch.float16, _CPU)
                torch.ops.latentfast.gather_rows_multi_into.default(data.tensors, data.row_sources, row_offsets, widths, pitch,
                                                                     table.rows, torch.zeros((1, 1, 1), dtype=torch.float16),
                                                                     padded, spec.backend)
                host.copy_(padded.view(len(lengths), -1)[torch.arange(padded.shape[-1])[None, :] < lengths[:, None]])
    values = host.view(torch.uint8).view(batch.dtype).view(batch.shape)
    if on_cpu:
        return values
    return take(out, name, batch.shape, batch.dtype, device).copy_(values, non_blocking=True)


def _shaped_batch(table, device, dtype, out, backend, cold, buffers=None, name="latent"):
    """A shaped cache's batch: the items' one line each, viewed as ``[B, *shape]`` (into ``out``, or
    ``buffers``' entry ``name``, when given)."""
    B, shape = table.index.numel(), table.shape
    if B == 0:
        return torch.empty((0,) * (1 + table.shapes.shape[1]), dtype=dtype), torch.from_numpy(table.shapes)
    if dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    on_cpu = device.__class__ is str or device.type == "cpu"
    stored = table.cache.dtype
    if out is None and buffers is not None and stored == torch.float16:
        out = take(buffers, name, (B, *shape), dtype, device)
    if stored == torch.float16:  # the gather casts while it copies
        flat_out = None if out is None else out.view(B, 1, 1, table.width)  # (checked in resolve)
        latents = _copy(table, on_cpu, device, dtype, flat_out, backend, cold)
        return latents.view(B, *shape), torch.from_numpy(table.shapes)
    # bfloat16 / float32 latents: the gather copies their 2-byte units as they are, viewed in the stored dtype
    units_out = None
    if out is not None and dtype == stored:  # a given output of the stored dtype: gathered into, no second copy
        units_out = _as_units(out, B, table.width)
    elif buffers is not None:
        units_out = (_as_units(take(buffers, name, (B, *shape), stored, device), B, table.width) if dtype == stored
                     else take(buffers, name + ".units", (B, 1, 1, table.width), torch.float16, device))
    units = _copy(table, on_cpu, device, torch.float16, units_out, backend, cold)
    latents = units.view(B, -1).view(stored).view(B, *shape)
    if out is not None and dtype == stored:
        return out, torch.from_numpy(table.shapes)
    if out is None and buffers is not None and dtype != stored:
        out = take(buffers, name, (B, *shape), dtype, device)
    if out is not None:
        return out.copy_(latents), torch.from_numpy(table.shapes)
    return latents.to(dtype), torch.from_numpy(table.shapes)


def _as_units(tensor: torch.Tensor, B: int, width: int) -> torch.Tensor:
    """A contiguous ``[B, ...]`` output whose items are whole 2-byte units, viewed as the gather's
    ``[B, 1, 1, width]`` float16 output (the same bytes)."""
    return tensor.view(B, -1).view(torch.uint8).view(torch.float16).view(B, 1, 1, width)


def _copy(table, on_cpu: bool, device, dtype, out, backend, cold) -> torch.Tensor:
    """The batch of ``table`` as ``[B, lines C, h, W]`` of ``dtype`` on the CPU or a CUDA device."""
    if table.cache.remote is not None:  # a cache in object storage: its rows fetched and held while copied
        layout.recheck(table)
        with layout.holding_items(table.cache, table.index_np):
            return _copy_local(table, on_cpu, device, dtype, out, backend, cold)
    return _copy_local(table, on_cpu, device, dtype, out, backend, cold)


def _copy_local(table, on_cpu: bool, device, dtype, out, backend, cold) -> torch.Tensor:
    if on_cpu:
        return _gather_cpu(table, dtype, out, backend, cold)
    if device.type != "cuda":
        raise InvalidArgumentError(f"device must be a CPU or CUDA device, got {device}")
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(f"read_batch(device={str(device)!r}): CUDA is not available here; use device='cpu'")
    if not isinstance(table.source[0], torch.Tensor):  # sharded: one host gather over the shards, then one copy
        host = _gather_cpu(table, torch.float16, None, backend, cold)
        return host.to(device, dtype) if out is None else out.copy_(host.view(out.shape))
    with torch.cuda.device(device):  # every allocation, launch and stream below belongs to `device`
        state = _before_copy(table, cold)
        return device_path.stage_and_expand(table, device, dtype, out, backend, state)


def _gather_cpu(table, dtype, out, backend, cold) -> torch.Tensor:
    """The CPU path, trimmed for small batches, where fixed per-call costs rival the copy."""
    if out is None:  # (a given out was checked in resolve)
        out = fresh_host((table.index.numel(), table.channels, table.latent_h, table.width), dtype)
    white = table.white
    if white is not None and (white.dtype != torch.float16 or not white.is_contiguous()):
        white = white.to(torch.float16).contiguous()
    state = _before_copy(table, cold)
    start = time.perf_counter() if state is not None else 0.0
    data, row_offsets, widths, pitch = table.source
    if not isinstance(data, torch.Tensor):  # a sharded cache's ShardSources: the one gather over every shard's data
        torch.ops.latentfast.gather_rows_multi_into.default(data.tensors, data.row_sources, row_offsets, widths, pitch,
                                                             table.rows, white, out, backend)
    else:
        torch.ops.latentfast.gather_rows_into.default(data, row_offsets, widths, pitch, table.rows, white, out, backend)
    if state is not None and state.hot:  # a hot batch pays this clock read and a compare
        seconds = time.perf_counter() - start
        if seconds > coldread.SLOW_FLOOR_S:
            state.after_copy(seconds, lambda: int(table.widths.sum(dtype=np.int64)) * table.lines * ELEMENT_BYTES)
    return out


def _before_copy(table, cold):
    """The cold-read path before a batch's copy: the cache's
    :class:`~latentfast.cache.feed.coldread.ColdReads` (None when ``cold`` is False or the cache cannot
    have one), which asks for the batch's missing pages unless batches have been found hot; a map
    seen for the first time is marked MADV_RANDOM."""
    if cold is False:
        return None
    state = coldread.cold_reads(table.cache)
    if state is None or (state.hot and cold is not True):
        return state
    state.advise_map(table.source[0])
    state.before_copy(table, always=cold is True)
    return state
