"""The compiled kernels of ``latentfast._C`` as the ``cpp`` (CPU) and ``cuda`` (CUDA) backends.

``_C`` implements ``latentfast_compiled::<op>`` (see :mod:`latentfast._ops`); an op gets a backend
here only for the dispatch keys the build really filled (a CPU-only build has no ``cuda`` backend).
"""
from __future__ import annotations

from .. import _ops
from . import mark_unavailable, register_kernel

_KEYS = (("CPU", "cpu", "cpp"), ("CUDA", "cuda", "cuda"))


def status() -> str:
    if _ops.C_LOAD_ERROR is not None:
        return f"NOT loaded: {_ops.C_LOAD_ERROR}"
    from .. import _C

    return f"loaded, built with {getattr(_C, 'BUILD_INFO', '(unknown configuration)')}"


def _register() -> None:
    for op in _ops.SCHEMAS:
        for key, device_type, backend in _KEYS:
            if _ops.C_LOAD_ERROR is not None:
                mark_unavailable(op, device_type, backend, f"latentfast._C not loaded ({_ops.C_LOAD_ERROR})")
            elif _ops.compiled_kernel_registered(op, key):
                register_kernel(op, device_type, backend, checks_arguments=True)(_ops.compiled_op(op))
            elif device_type == "cuda":
                mark_unavailable(op, device_type, backend, f"_C was built without a CUDA kernel for {op}")
            else:
                mark_unavailable(op, device_type, backend, f"_C has no CPU kernel for {op}")
        mark_unavailable(op, "cpu", "cuda", "the tensors are on the CPU")
        mark_unavailable(op, "cuda", "cpp", "the tensors are on a CUDA device")


_register()
