"""Every op's schema, declared once, and its shape checks (which are also its fake kernel).

Each op exists in two namespaces, both from the one schema in :data:`SCHEMAS`:

- ``latentfast::<op>(..., str backend="auto")`` is the op everyone calls: the public functions in
  :mod:`latentfast.ops`, users, ``torch.compile`` graphs. Its CPU and CUDA kernels are registered
  by :mod:`latentfast.backends`: one per dispatch key, which runs the backend that ``backend`` (or
  ``LATENTFAST_BACKEND``) selects -- the compiled kernel, the Triton kernel or the pure-torch
  reference.
- ``latentfast_compiled::<op>(...)`` is the same schema without ``backend``, implemented on CPU by
  the native library ``latentfast/_native.so`` (``csrc/``, called through ctypes by
  :mod:`latentfast.backends.native`) when it loads. It is the ``cpp`` backend of the public op
  called past the op's Python checks, nothing more.

Kernels implement the ``*_into`` form (they write into caller-provided outputs, so ``out=`` and
pinned staging buffers need no extra copy); the functions in :mod:`latentfast.ops` allocate and
call it. The checks here look at shapes, dtypes and devices only (never at values, so they trace):
the fake kernel runs them under ``torch.compile`` and the dispatch-key kernel runs them before any
backend. Value checks (an index out of range, a row past the end of the data) are each kernel's own.
"""
from __future__ import annotations

import torch

NAMESPACE = "latentfast"
COMPILED_NAMESPACE = "latentfast_compiled"

# op name -> kernel-form schema (without ``backend``); reference.<op name> is its pure-torch implementation
SCHEMAS: dict[str, str] = {
    # uint8 [..., C, T, H, W] -> len(out) views [..., C, T/len(out), H, W] of x / 127.5 - 1
    "normalize_uint8_into": "normalize_uint8_into(Tensor x, Tensor(a!)[] out) -> ()",
    # padded [B, C, h, W] batch straight out of the cache's flat f16 data (the CPU read path)
    "gather_rows_into": "gather_rows_into(Tensor data, Tensor row_offsets, Tensor widths, int pitch, "
    "Tensor indices, Tensor? white, Tensor(a!) out) -> ()",
    # the same rows' real columns only, back to back (the pinned staging of the GPU read path)
    "gather_rows_packed_into": "gather_rows_packed_into(Tensor data, Tensor row_offsets, Tensor widths, "
    "int pitch, Tensor indices, int channels, int latent_h, Tensor(a!) out) -> ()",
    # as gather_rows_into, row i read from data[row_sources[i]]: one batch over the shards of a sharded cache
    "gather_rows_multi_into": "gather_rows_multi_into(Tensor[] data, Tensor row_sources, Tensor row_offsets, "
    "Tensor widths, int pitch, Tensor indices, Tensor? white, Tensor(a!) out) -> ()",
    # packed rows -> padded [B, C, h, W] with the white column, cast (on the device)
    "expand_rows_into": "expand_rows_into(Tensor packed, Tensor packed_offsets, Tensor widths, Tensor? white, "
    "Tensor(a!) out) -> ()",
    # bytes [offsets[k], offsets[k] + lengths[k]) of an open file, back to back, by `threads` pread workers
    "read_spans_into": "read_spans_into(int fd, Tensor offsets, Tensor lengths, int threads, Tensor(a!) out) -> ()",
    # per-branch leaf gradients -> every (microbatch, branch) block once per scale, one arena
    "scatter_cotangents_into": "scatter_cotangents_into(Tensor[] grads, int[] batch_sizes, float[] scales, "
    "Tensor(a!) arena) -> ()",
    # out[b] = mean[b] + std[b] * eps(item_seeds[b], element): reproducible latent sampling (latentfast.sampling)
    "sample_latents_into": "sample_latents_into(Tensor mean, Tensor std, Tensor item_seeds, Tensor(a!) out) -> ()",
}


def public_schema(schema: str) -> str:
    """The public op's schema: the kernel form plus a trailing ``str backend="auto"`` argument."""
    head, _, tail = schema.rpartition(") ->")
    return f'{head}, str backend="auto") ->{tail}'


LIB = torch.library.Library(NAMESPACE, "DEF")  # noqa: TOR901 - the namespaces are ours alone
COMPILED_LIB = torch.library.Library(COMPILED_NAMESPACE, "DEF")  # noqa: TOR901
for _schema in SCHEMAS.values():
    LIB.define(public_schema(_schema))
    COMPILED_LIB.define(_schema)

# ---------------------------------------------------------------------------------------------
# the native library's kernels (latentfast/backends/compiled.py registers them on latentfast_compiled::*)
# ---------------------------------------------------------------------------------------------
def compiled_kernel_registered(op: str, dispatch_key: str) -> bool:
    """Whether a compiled kernel of ``op`` is registered under ``dispatch_key`` ("CPU" or "CUDA")."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{COMPILED_NAMESPACE}::{op}", dispatch_key)


def compiled_op(op: str):
    """``torch.ops.latentfast_compiled.<op>.default``: the compiled kernel form of ``op``."""
    return getattr(getattr(torch.ops, COMPILED_NAMESPACE), op).default


# ---------------------------------------------------------------------------------------------
# shape checks = fake kernels (shapes, dtypes and devices only; they run traced and eager)
# ---------------------------------------------------------------------------------------------
FLOAT_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT64_MAX = 2**63 - 1  # the largest size an op's int arguments and the kernels' int64 arithmetic hold
CHECKS: dict = {}


def _shape_check(op: str):
    """Register ``fn`` as ``op``'s fake kernel and as its eager pre-check (see module docstring)."""

    def wrap(fn):
        CHECKS[op] = fn
        torch.library.register_fake(f"{NAMESPACE}::{op}")(fn)
        return fn

    return wrap


def _check_vector(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    torch._check_value(
        tensor.dtype == dtype and tensor.dim() == 1 and tensor.is_contiguous(),
        lambda: f"{name} must be a contiguous 1-D {dtype} tensor, got {tensor.dtype} {tuple(tensor.shape)}",
    )


def _check_output(name: str, out: torch.Tensor, dims: int, dtypes, device: torch.device) -> None:
    torch._check_value(out.dim() == dims, lambda: f"{name} must be {dims}-D, got shape {tuple(out.shape)}")
    torch._check_value(out.dtype in dtypes, lambda: f"{name} dtype must be one of {dtypes}, got {out.dtype}")
    torch._check_value(out.device == device, lambda: f"{name} must be on {device}, got {out.device}")
    torch._check_value(out.is_contiguous(), lambda: f"{name} must be contiguous, got strides {tuple(out.stride())}")


def _check_white(white, out_shape, device: torch.device) -> None:
    if white is None:
        return
    lines = out_shape[1] * out_shape[2]
    torch._check_value(
        white.dtype == torch.float16 and white.numel() == lines and white.is_contiguous() and white.device == device,
        lambda: f"white must be a contiguous float16 tensor of C*h = {lines} values on {device}, got "
        f"{white.dtype} {tuple(white.shape)} on {white.device}",
    )


@_shape_check("normalize_uint8_into")
def _normalize_uint8_into_check(x, out, backend="auto"):
    torch._check_value(x.dtype == torch.uint8, lambda: f"x must be uint8 pixels, got dtype {x.dtype}")
    torch._check_value(x.dim() >= 4, lambda: f"x must be [..., C, T, H, W] (at least 4-D), got {tuple(x.shape)}")
    views = len(out)
    torch._check_value(views >= 1, lambda: "out must hold at least one tensor")
    torch._check_value(
        x.shape[-3] % views == 0, lambda: f"T={x.shape[-3]} (x.shape[-3]) is not divisible by num_views={views}"
    )
    view_shape = (*x.shape[:-3], x.shape[-3] // views, *x.shape[-2:])
    for v, target in enumerate(out):
        _check_output(f"out[{v}]", target, len(view_shape), FLOAT_OUT_DTYPES, x.device)
        torch._check_value(
            tuple(target.shape) == view_shape, lambda: f"out[{v}] must have shape {view_shape}, got {tuple(target.shape)}"
        )
        torch._check_value(target.dtype == out[0].dtype, lambda: f"out[{v}] dtype {target.dtype} != out[0] dtype {out[0].dtype}")


def _check_gather_source(data, row_offsets, widths, pitch, indices) -> None:
    for name, tensor in (("data", data), ("row_offsets", row_offsets), ("widths", widths), ("indices", indices)):
        torch._check_value(tensor.device.type == "cpu", lambda: f"{name} must be a CPU tensor, got {tensor.device}")
    _check_vector("data", data, torch.float16)
    _check_vector("row_offsets", row_offsets, torch.int64)
    _check_vector("widths", widths, torch.int32)
    _check_vector("indices", indices, torch.int64)
    torch._check_value(
        widths.numel() == row_offsets.numel(),
        lambda: f"widths has {widths.numel()} rows but row_offsets has {row_offsets.numel()}",
    )
    torch._check_value(pitch >= 0, lambda: f"pitch must be >= 0 (0 = ragged layout), got {pitch}")


@_shape_check("gather_rows_into")
def _gather_rows_into_check(data, row_offsets, widths, pitch, indices, white, out, backend="auto"):
    _check_gather_source(data, row_offsets, widths, pitch, indices)
    _check_output("out", out, 4, FLOAT_OUT_DTYPES, torch.device("cpu"))
    torch._check_value(
        out.shape[0] == indices.numel(), lambda: f"out has B={out.shape[0]} rows but indices has {indices.numel()}"
    )
    _check_white(white, out.shape, torch.device("cpu"))


@_shape_check("gather_rows_multi_into")
def _gather_rows_multi_into_check(data, row_sources, row_offsets, widths, pitch, indices, white, out, backend="auto"):
    for k, source in enumerate(data):
        torch._check_value(source.device.type == "cpu", lambda: f"data[{k}] must be a CPU tensor, got {source.device}")
        _check_vector(f"data[{k}]", source, torch.float16)
    _check_gather_source(torch.empty(0, dtype=torch.float16), row_offsets, widths, pitch, indices)
    torch._check_value(row_sources.device.type == "cpu", lambda: f"row_sources must be a CPU tensor, got {row_sources.device}")
    _check_vector("row_sources", row_sources, torch.int32)
    torch._check_value(
        row_sources.numel() == row_offsets.numel(),
        lambda: f"row_sources has {row_sources.numel()} rows but row_offsets has {row_offsets.numel()}",
    )
    _check_output("out", out, 4, FLOAT_OUT_DTYPES, torch.device("cpu"))
    torch._check_value(
        out.shape[0] == indices.numel(), lambda: f"out has B={out.shape[0]} rows but indices has {indices.numel()}"
    )
    _check_white(white, out.shape, torch.device("cpu"))


@_shape_check("gather_rows_packed_into")
def _gather_rows_packed_into_check(data, row_offsets, widths, pitch, indices, channels, latent_h, out, backend="auto"):
    _check_gather_source(data, row_offsets, widths, pitch, indices)
    torch._check_value(
        channels >= 0 and latent_h >= 0, lambda: f"channels and latent_h must be >= 0, got {channels}, {latent_h}"
    )
    torch._check_value(
        channels * latent_h <= INT64_MAX,
        lambda: f"channels * latent_h = {channels} * {latent_h} does not fit in int64",
    )
    _check_output("out", out, 1, (torch.float16,), torch.device("cpu"))


@_shape_check("expand_rows_into")
def _expand_rows_into_check(packed, packed_offsets, widths, white, out, backend="auto"):
    device = packed.device
    _check_vector("packed", packed, torch.float16)
    _check_vector("packed_offsets", packed_offsets, torch.int64)
    _check_vector("widths", widths, torch.int32)
    for name, tensor in (("packed_offsets", packed_offsets), ("widths", widths)):
        torch._check_value(tensor.device == device, lambda: f"{name} must be on {device}, got {tensor.device}")
    torch._check_value(
        packed_offsets.numel() == widths.numel(),
        lambda: f"packed_offsets has {packed_offsets.numel()} rows but widths has {widths.numel()}",
    )
    _check_output("out", out, 4, FLOAT_OUT_DTYPES, device)
    torch._check_value(out.shape[0] == widths.numel(), lambda: f"out has B={out.shape[0]} rows but widths has {widths.numel()}")
    _check_white(white, out.shape, device)


@_shape_check("read_spans_into")
def _read_spans_into_check(fd, offsets, lengths, threads, out, backend="auto"):
    torch._check_value(fd >= 0, lambda: f"fd must be an open file descriptor, got {fd}")
    torch._check_value(1 <= threads <= 256, lambda: f"threads must be in [1, 256], got {threads}")
    for name, tensor in (("offsets", offsets), ("lengths", lengths)):
        torch._check_value(tensor.device.type == "cpu", lambda: f"{name} must be a CPU tensor, got {tensor.device}")
        _check_vector(name, tensor, torch.int64)
    torch._check_value(
        offsets.numel() == lengths.numel(),
        lambda: f"offsets has {offsets.numel()} spans but lengths has {lengths.numel()}",
    )
    _check_output("out", out, 1, (torch.uint8,), torch.device("cpu"))


SCATTER_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@_shape_check("scatter_cotangents_into")
def _scatter_cotangents_into_check(grads, batch_sizes, scales, arena, backend="auto"):
    torch._check_value(len(grads) >= 1, lambda: "grads must hold at least one tensor")
    torch._check_value(len(batch_sizes) >= 1, lambda: "batch_sizes must hold at least one microbatch size")
    torch._check_value(len(scales) in (1, 2), lambda: f"scales must hold 1 or 2 factors, got {len(scales)}")
    torch._check_value(arena.dim() == 1 and arena.is_contiguous(), lambda: f"arena must be contiguous 1-D, got {tuple(arena.shape)}")
    torch._check_value(arena.dtype in SCATTER_DTYPES, lambda: f"arena dtype must be one of {SCATTER_DTYPES}, got {arena.dtype}")
    torch._check_value(grads[0].dtype in SCATTER_DTYPES, lambda: f"grads dtype must be one of {SCATTER_DTYPES}, got {grads[0].dtype}")
    for m, size in enumerate(batch_sizes):
        torch._check_value(size > 0, lambda: f"batch_sizes[{m}] must be positive, got {size}")
    b_local = sum(batch_sizes)
    slab_sum = 0
    for k, grad in enumerate(grads):
        torch._check_value(grad.dim() == 3, lambda: f"grads[{k}] must be [b_local, N, D], got shape {tuple(grad.shape)}")
        torch._check_value(grad.device == arena.device, lambda: f"grads[{k}] is on {grad.device}, arena on {arena.device}")
        torch._check_value(grad.dtype == grads[0].dtype, lambda: f"grads[{k}] dtype {grad.dtype} differs from grads[0] dtype {grads[0].dtype}")
        torch._check_value(
            grad.shape[0] == b_local, lambda: f"grads[{k}] has {grad.shape[0]} rows but batch_sizes sum to {b_local}"
        )
        slab_sum = slab_sum + grad.shape[1] * grad.shape[2]
    # Python ints do not wrap: a size the kernels' int64 arithmetic cannot hold is refused here too
    needed = len(scales) * b_local * slab_sum
    torch._check_value(needed <= INT64_MAX, lambda: f"len(scales) * b_local * sum(N*D) = {needed} overflows int64")
    torch._check_value(
        arena.numel() == needed,
        lambda: f"arena must hold len(scales) * b_local * sum(N*D) = {needed} elements, got {arena.numel()}",
    )


SAMPLE_DTYPES = FLOAT_OUT_DTYPES


def _check_sample_tensor(name: str, tensor: torch.Tensor, mean: torch.Tensor) -> None:
    torch._check_value(tensor.dtype in SAMPLE_DTYPES,
                       lambda: f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")
    torch._check_value(tensor.shape == mean.shape and tensor.device == mean.device,
                       lambda: f"{name} must match mean's shape {list(mean.shape)} on {mean.device}, "
                       f"got {list(tensor.shape)} on {tensor.device}")


def _check_distinct_elements(name: str, out: torch.Tensor) -> None:
    """Refuse an output whose elements share memory (a stride-0 or self-overlapping view: two threads
    would write one address). Sufficient test, as the C++ kernel's: sorted by stride, each dim of size > 1
    steps past the span of the dims inside it."""
    span = 0
    for stride, size in sorted((abs(st), sz) for st, sz in zip(out.stride(), out.shape) if sz > 1):
        torch._check_value(stride > span, lambda: f"{name} has elements that share memory (strides {tuple(out.stride())}); "
                           "it must be a tensor whose elements are distinct")
        span += stride * (size - 1)


@_shape_check("sample_latents_into")
def _sample_latents_into_check(mean, std, item_seeds, out, backend="auto"):
    torch._check_value(mean.dim() >= 1, lambda: "mean must be a [B, ...] batch (one item per row), got a 0-d tensor")
    for name, tensor in (("mean", mean), ("std", std), ("out", out)):
        _check_sample_tensor(name, tensor, mean)
    torch._check_value(
        item_seeds.dtype == torch.int64 and item_seeds.dim() == 1 and item_seeds.shape[0] == mean.shape[0]
        and item_seeds.device in (mean.device, torch.device("cpu")),
        lambda: f"item_seeds must be int64 [{mean.shape[0]}] (one per item, from item_seeds()) on {mean.device} or "
        f"the CPU, got {item_seeds.dtype} {list(item_seeds.shape)} on {item_seeds.device}",
    )
    _check_distinct_elements("out", out)
