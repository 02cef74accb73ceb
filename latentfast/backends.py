"""What can run each op here, and how a backend is chosen.

``backend="auto"`` (the default of every public op) picks, by the tensors' device:
compiled kernel (``cpp`` on CPU, ``cuda`` on CUDA) -> Triton (CUDA) -> pure-torch reference.
``"cpp" | "cuda" | "triton" | "torch"`` force one and raise if it cannot run here. The
environment variable ``LATENTFAST_BACKEND`` replaces ``"auto"`` globally.

Triton kernels also run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``
set before Triton is imported); that is how the tests exercise them without a GPU.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from functools import lru_cache

import torch

from . import _ops, reference

BACKENDS = ("auto", "cpp", "cuda", "triton", "torch")


from .errors import BackendUnavailableError  # noqa: E402  (re-exported: backends.BackendUnavailableError)


@lru_cache(maxsize=None)
def triton_status() -> tuple[bool, str]:
    """(importable, why not)."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    try:
        import triton  # noqa: F401
    except Exception as exc:  # pragma: no cover - a broken triton install
        return False, f"import triton failed: {exc}"
    return True, ""


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_function(op: str):
    ok, why = triton_status()
    if not ok:
        return None, why
    fn = _ops._triton_kernel(op)
    if fn is None:
        return None, f"no Triton kernel for {op}"
    return fn, ""


def availability(op: str, device_type: str) -> dict[str, str]:
    """backend -> "" if it can run ``op`` on ``device_type`` tensors, else the reason it cannot."""
    reasons: dict[str, str] = {"torch": ""}
    cpu_compiled = _ops.compiled_kernel_registered(op, "CPU")
    cuda_compiled = _ops.compiled_kernel_registered(op, "CUDA")
    build_note = f"latentfast._C not loaded ({_ops.C_LOAD_ERROR})" if _ops.C_LOAD_ERROR else ""
    if device_type == "cpu":
        reasons["cpp"] = "" if cpu_compiled else (build_note or f"_C has no CPU kernel for {op}")
        reasons["cuda"] = "the tensors are on the CPU"
    else:
        reasons["cpp"] = f"the tensors are on {device_type}"
        reasons["cuda"] = "" if cuda_compiled else (build_note or f"_C was built without CUDA kernels for {op}")
    fn, why = _triton_function(op) if device_type == "cuda" or triton_interpreting() else (None, "")
    if fn is not None:
        reasons["triton"] = ""
    elif device_type == "cpu" and not why:
        reasons["triton"] = "CPU tensors need TRITON_INTERPRET=1 (Triton's interpreter)"
    else:
        reasons["triton"] = why
    return reasons


def resolve(op: str, device_type: str, backend: str = "auto") -> str:
    """The concrete backend that will run ``op`` on ``device_type`` tensors."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    source = "argument backend"
    if backend == "auto":
        env = os.environ.get("LATENTFAST_BACKEND", "").strip()
        if env and env != "auto":
            if env not in BACKENDS:
                raise ValueError(f"LATENTFAST_BACKEND must be one of {BACKENDS}, got {env!r}")
            backend, source = env, "LATENTFAST_BACKEND"
    reasons = availability(op, device_type)
    if backend == "auto":
        order = ("cpp", "torch") if device_type == "cpu" else ("cuda", "triton", "torch")
        return next(name for name in order if not reasons.get(name))
    if reasons.get(backend):
        raise BackendUnavailableError(
            f"{source}={backend!r} cannot run latentfast::{op} on {device_type} tensors: {reasons[backend]}"
        )
    return backend


def kernel(op: str, device_type: str, backend: str = "auto"):
    """(callable implementing the kernel form of ``op``, the backend name it belongs to)."""
    chosen = resolve(op, device_type, backend)
    if chosen == "torch":
        return getattr(reference, op), chosen
    if chosen == "triton":
        return _triton_function(op)[0], chosen
    return getattr(torch.ops.latentfast, op).default, chosen


def describe() -> str:
    """A human-readable report: build, Triton, and the backend each op gets per device."""
    lines = [
        f"latentfast backends (torch {torch.__version__}, cuda {torch.version.cuda})",
        f"  compiled library _C: {'loaded' if _ops.C_LOAD_ERROR is None else 'NOT loaded: ' + _ops.C_LOAD_ERROR}",
        f"  triton: {'importable' if triton_status()[0] else triton_status()[1]}"
        + (" (interpreter mode)" if triton_interpreting() else ""),
        f"  LATENTFAST_BACKEND: {os.environ.get('LATENTFAST_BACKEND') or '(unset)'}",
    ]
    for op in _ops.SCHEMAS:
        for device_type in ("cpu", "cuda"):
            reasons = availability(op, device_type)
            auto = resolve(op, device_type, "auto") if not os.environ.get("LATENTFAST_BACKEND") else "-"
            avail = ", ".join(name for name, why in reasons.items() if not why)
            missing = "; ".join(f"{name}: {why}" for name, why in reasons.items() if why)
            lines.append(f"  {op:<26} {device_type:<5} auto={auto:<7} available=[{avail}]  ({missing})")
    return "\n".join(lines)
