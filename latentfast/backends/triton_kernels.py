"""The Triton kernels (``latentfast/kernels/<op>.py``, installed as ``latentfast.kernels``) as the ``triton``
backend: on CUDA tensors, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``).

Importing latentfast never imports Triton: a kernel module is imported on the op's first call.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from functools import lru_cache

from .. import _ops
from . import mark_unavailable, register_kernel


@lru_cache(maxsize=None)
def triton_status() -> tuple[bool, str]:
    """(importable, why not) -- without importing Triton."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    return True, ""


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _module_name(op: str) -> str:
    return f"latentfast.kernels.{op.removesuffix('_into')}"


def _lazy(op: str):
    """The Triton function of ``op``, imported on first call."""
    loaded = []

    def run(*args):
        if not loaded:
            loaded.append(getattr(importlib.import_module(_module_name(op)), op))
        return loaded[0](*args)

    run.__name__ = f"{op}_triton"
    return run


def _register() -> None:
    importable, why = triton_status()
    for op in _ops.SCHEMAS:
        has_kernel = importlib.util.find_spec(_module_name(op)) is not None
        for device_type in ("cpu", "cuda"):
            if not has_kernel:
                mark_unavailable(op, device_type, "triton", f"no Triton kernel for {op}")
            elif not importable:
                mark_unavailable(op, device_type, "triton", why)
            elif device_type == "cpu" and not triton_interpreting():
                mark_unavailable(op, device_type, "triton", "CPU tensors need TRITON_INTERPRET=1 (Triton's interpreter)")
            else:
                register_kernel(op, device_type, "triton")(_lazy(op))


_register()
