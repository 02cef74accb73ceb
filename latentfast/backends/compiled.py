"""The native library's kernels (:mod:`latentfast.backends.native`) as the ``cpp`` backend on CPU.

Each kernel is registered twice: as the ``cpp`` backend of the public op (called straight from its
dispatch kernel, the hot path) and as the CPU kernel of ``latentfast_compiled::<op>`` (the kernel form
without ``backend``, for direct calls past the op's Python checks). There are no CUDA C++ kernels:
the GPU kernels are Triton (``latentfast/kernels/``, the ``triton`` backend), so the ``cuda`` backend is never
available.
"""
from __future__ import annotations

from .. import _ops
from . import mark_unavailable, native, register_kernel

NO_CUDA_KERNELS = "no CUDA C++ kernels: the GPU kernels are Triton (backend='triton')"


def status() -> str:
    if native.LOAD_ERROR is not None:
        return f"NOT loaded: {native.LOAD_ERROR}"
    return f"loaded ({native.PATH}); built with {native.build_info()}; CPU vector paths on this machine: {native.cpu_paths()}"


def _register() -> None:
    for op in _ops.SCHEMAS:
        kernel = native.KERNELS.get(op)
        if native.LOAD_ERROR is not None:
            mark_unavailable(op, "cpu", "cpp", f"the native library is not loaded ({native.LOAD_ERROR})")
        elif kernel is None:
            mark_unavailable(op, "cpu", "cpp", f"the native library has no CPU kernel for {op}")
        else:
            _ops.COMPILED_LIB.impl(op, kernel, "CPU")
            register_kernel(op, "cpu", "cpp", checks_arguments=True)(kernel)
        mark_unavailable(op, "cuda", "cuda", NO_CUDA_KERNELS)
        mark_unavailable(op, "cpu", "cuda", "the tensors are on the CPU")
        mark_unavailable(op, "cuda", "cpp", "the tensors are on a CUDA device")


_register()
