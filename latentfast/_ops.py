"""Every op's schema, declared once, with its fake (meta) kernel.

The compiled kernels in ``csrc/`` only *implement* these schemas (``TORCH_LIBRARY_IMPL``).
Whatever the build produced, every op works afterwards on every device: a dispatch key the
compiled library did not fill gets the Triton kernel (CUDA, when Triton is installed) or the
pure-torch reference from :mod:`latentfast.reference`. ``backends.describe()`` says which.

Convention: kernels implement the ``*_into`` form (write into caller-provided outputs, so
``out=`` and pinned staging buffers need no extra copy); the functional form allocates and
calls it.
"""
from __future__ import annotations

import importlib
import os
import warnings

import torch

from . import reference

LIB = torch.library.Library("latentfast", "DEF")  # noqa: TOR901 - the namespace is ours alone

# op name -> schema; reference.<op name> is its pure-torch implementation
SCHEMAS: dict[str, str] = {
    "normalize_uint8_into": "normalize_uint8_into(Tensor x, Tensor(a!)[] out) -> ()",
}

# ---- cache decode ops (gather) -------------------------------------------------------------
# (issue 4 adds its schemas here with SCHEMAS.update({...}))
SCHEMAS.update(
    {
        # padded [B, C, h, W] batch straight out of the cache's flat f16 data (the CPU path)
        "gather_rows_into": "gather_rows_into(Tensor data, Tensor row_offsets, Tensor widths, int pitch, "
        "Tensor indices, Tensor? white, Tensor(a!) out) -> ()",
        # the same rows' real columns only, back to back (the pinned staging of the GPU path)
        "gather_rows_packed_into": "gather_rows_packed_into(Tensor data, Tensor row_offsets, Tensor widths, "
        "int pitch, Tensor indices, int channels, int latent_h, Tensor(a!) out) -> ()",
        # packed rows -> padded [B, C, h, W] with the white column, cast (on the device)
        "expand_rows_into": "expand_rows_into(Tensor packed, Tensor packed_offsets, Tensor widths, Tensor? white, "
        "Tensor(a!) out) -> ()",
    }
)


# ---- replay ops (cotangent scatter) --------------------------------------------------------
# (issue 6 adds its schemas here with SCHEMAS.update({...}))
SCHEMAS.update(
    {
        "scatter_cotangents_into": (
            "scatter_cotangents_into(Tensor[] grads, int[] batch_sizes, float scale, Tensor(a!) arena) -> ()"
        ),
    }
)


for _schema in SCHEMAS.values():
    LIB.define(_schema)

# ---------------------------------------------------------------------------------------------
# compiled library
# ---------------------------------------------------------------------------------------------
C_LOAD_ERROR: str | None = None
try:
    if os.environ.get("LATENTFAST_DISABLE_C") == "1":
        raise ImportError("LATENTFAST_DISABLE_C=1")
    from . import _C  # noqa: F401  (registers the CPU / CUDA kernels with the dispatcher)
except ImportError as exc:  # a missing or broken build must never break import
    C_LOAD_ERROR = f"{type(exc).__name__}: {exc}"
    if os.environ.get("LATENTFAST_DISABLE_C") != "1":
        warnings.warn(
            f"latentfast._C could not be loaded ({C_LOAD_ERROR}); using the pure-torch reference",
            RuntimeWarning,
            stacklevel=2,
        )


def compiled_kernel_registered(op: str, dispatch_key: str) -> bool:
    """Whether ``latentfast._C`` registered a kernel for ``op`` under ``dispatch_key``."""
    if (op, dispatch_key) in FALLBACKS:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"latentfast::{op}", dispatch_key)


# ---------------------------------------------------------------------------------------------
# fake kernels (shapes only, for torch.compile / meta tensors)
# ---------------------------------------------------------------------------------------------
@torch.library.register_fake("latentfast::normalize_uint8_into")
def _normalize_uint8_into_fake(x, out):
    return None


# ---- cache decode fake kernels (issue 4) ----------------------------------------------------
@torch.library.register_fake("latentfast::gather_rows_into")
def _gather_rows_into_fake(data, row_offsets, widths, pitch, indices, white, out):
    return None


@torch.library.register_fake("latentfast::gather_rows_packed_into")
def _gather_rows_packed_into_fake(data, row_offsets, widths, pitch, indices, channels, latent_h, out):
    return None


@torch.library.register_fake("latentfast::expand_rows_into")
def _expand_rows_into_fake(packed, packed_offsets, widths, white, out):
    return None


# ---- replay fake kernels (issue 6) ----------------------------------------------------------
@torch.library.register_fake("latentfast::scatter_cotangents_into")
def _scatter_cotangents_into_fake(grads, batch_sizes, scale, arena):
    return None



# ---------------------------------------------------------------------------------------------
# fallbacks for dispatch keys the compiled library left empty
# ---------------------------------------------------------------------------------------------
FALLBACKS: dict[tuple[str, str], str] = {}  # (op, "CPU"|"CUDA") -> "triton" | "torch"


def _triton_kernel(op: str):
    """The Triton implementation of ``op`` or None (Triton missing or no such kernel)."""
    try:
        module = importlib.import_module(f"latentfast.kernels.{op.removesuffix('_into')}")
    except ImportError:
        return None
    return getattr(module, op, None)


def _cuda_fallback(op: str):
    """CUDA kernel for ``op`` when _C has none: Triton if importable (resolved on first call, so
    importing latentfast never imports Triton), else the reference."""
    cache: list = []

    def impl(*args):
        if not cache:
            cache.append(_triton_kernel(op) or getattr(reference, op))
        return cache[0](*args)

    return impl


def _register_fallbacks() -> None:
    for op in SCHEMAS:
        for key in ("CPU", "CUDA"):
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"latentfast::{op}", key):
                continue
            if key == "CPU":
                LIB.impl(op, getattr(reference, op), key)
                FALLBACKS[(op, key)] = "torch"
            else:
                LIB.impl(op, _cuda_fallback(op), key)
                FALLBACKS[(op, key)] = "triton or torch"


_register_fallbacks()
