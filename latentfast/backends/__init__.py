"""Which backend runs an op, chosen in one place: the kernel the dispatcher calls.

Every backend registers its implementation of an op's kernel form here with
:func:`register_kernel` (``backends/compiled.py``: the CPU kernels of the native library ``latentfast/_native.so``;
``backends/triton_kernels.py``: the Triton kernels; ``backends/reference.py``: the pure-torch
reference). For each op and each dispatch key (CPU, CUDA) one kernel is registered on the public
op ``latentfast::<op>``: it calls the implementation the op's ``backend`` argument selects, after
the op's shape checks and a check that no output overlaps another argument (the compiled kernels
make both checks themselves, in C++, before touching memory; so they are not repeated for them):

- ``"auto"`` (the default) picks, by the tensors' device, the compiled kernel (``cpp`` on CPU;
  ``cuda`` on CUDA, which no op has today: the GPU kernels are Triton), then Triton (CUDA), then the
  reference; the environment variable
  ``LATENTFAST_BACKEND`` replaces ``"auto"`` globally;
- ``"cpp" | "cuda" | "triton" | "torch"`` force one and raise :class:`BackendUnavailableError`
  (saying why) when it cannot run here.

So ``torch.ops.latentfast.<op>(..., backend=...)`` is the only path, and it traces under
``torch.compile(fullgraph=True)`` whatever the backend: the choice happens when the op runs.
Errors are the same on every backend: built-in ``ValueError``/``IndexError``/``TypeError`` raised by
a kernel (C++ ``TORCH_CHECK_VALUE``/``TORCH_CHECK_INDEX``, the reference) reach the caller as
:class:`~latentfast.errors.InvalidArgumentError`/:class:`~latentfast.errors.IndexOutOfRangeError`/
:class:`~latentfast.errors.ArgumentTypeError` with the same message.

Triton kernels also run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set
before Triton is imported); that is how the tests exercise them without a GPU.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch

from .. import _ops
from ..errors import (
    ArgumentTypeError,
    BackendUnavailableError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    LatentfastError,
)

BACKENDS = ("auto", "cpp", "cuda", "triton", "torch")
DEVICE_TYPES = ("cpu", "cuda")
AUTO_ORDER = {"cpu": ("cpp", "torch"), "cuda": ("cuda", "triton", "torch")}

# (op, device type) -> backend name -> (implementation of the op's kernel form, whether it checks its
# own arguments -- shapes and overlapping outputs -- so the dispatch kernel need not do it again)
_REGISTRY: dict[tuple[str, str], dict[str, tuple[Callable, bool]]] = {}
# (op, device type) -> backend name -> why it cannot run (only for registered-but-unusable backends)
_UNAVAILABLE: dict[tuple[str, str], dict[str, str]] = {}


def register_kernel(op: str, device_type: str, backend: str, *, checks_arguments: bool = False):
    """Decorator: ``fn`` implements ``op``'s kernel form on ``device_type`` tensors for ``backend``.

    ``checks_arguments``: ``fn`` refuses bad shapes and overlapping outputs itself (the compiled
    kernels do, before touching memory), so the op's Python checks are skipped on its hot path."""
    if op not in _ops.SCHEMAS or device_type not in DEVICE_TYPES or backend not in BACKENDS[1:]:
        raise InvalidArgumentError(f"unknown op/device/backend {(op, device_type, backend)!r}")

    def wrap(fn: Callable) -> Callable:
        _REGISTRY.setdefault((op, device_type), {})[backend] = (fn, checks_arguments)
        _RESOLVED.clear()
        return fn

    return wrap


def mark_unavailable(op: str, device_type: str, backend: str, why: str) -> None:
    """Record why ``backend`` cannot run ``op`` on ``device_type`` (shown by describe() and errors)."""
    _UNAVAILABLE.setdefault((op, device_type), {})[backend] = why


def availability(op: str, device_type: str) -> dict[str, str]:
    """backend -> "" if it can run ``op`` on ``device_type`` tensors, else the reason it cannot."""
    registered = _REGISTRY.get((op, device_type), {})
    reasons = {}
    for name in BACKENDS[1:]:
        if name in registered:
            reasons[name] = ""
        else:
            reasons[name] = _UNAVAILABLE.get((op, device_type), {}).get(name) or f"no {name} kernel for {op} on {device_type}"
    return reasons


def resolve(op: str, device_type: str, backend: str = "auto") -> str:
    """The concrete backend that runs ``op`` on ``device_type`` tensors when asked for ``backend``."""
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"backend must be one of {BACKENDS}, got {backend!r}")
    source = "argument backend"
    if backend == "auto":
        env = os.environ.get("LATENTFAST_BACKEND", "").strip()
        if env and env != "auto":
            if env not in BACKENDS:
                raise InvalidArgumentError(f"LATENTFAST_BACKEND must be one of {BACKENDS}, got {env!r}")
            backend, source = env, "LATENTFAST_BACKEND"
    reasons = availability(op, device_type)
    if backend == "auto":
        return next(name for name in AUTO_ORDER[device_type] if not reasons[name])
    if reasons[backend]:
        raise BackendUnavailableError(
            f"{source}={backend!r} cannot run latentfast::{op} on {device_type} tensors: {reasons[backend]}"
        )
    return backend


_RESOLVED: dict[tuple, tuple[Callable, bool]] = {}  # (op, device type, backend, LATENTFAST_BACKEND) -> entry
# os.environ.get costs ~1 us per op call (the key's encoding, and a KeyError inside Mapping.get when the
# variable is unset); on POSIX the mapping's bytes dict answers the same question in ~30 ns and follows
# every os.environ / monkeypatch change, since os.environ writes through it.
_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None


def _forced_backend():
    if _ENV_BYTES is not None:
        return _ENV_BYTES.get(b"LATENTFAST_BACKEND")
    return os.environ.get("LATENTFAST_BACKEND")


def implementation(op: str, device_type: str, backend: str = "auto") -> tuple[Callable, bool]:
    """``(fn, checks_arguments)`` of the backend ``resolve`` picks, memoized (it runs on every call of the op)."""
    key = (op, device_type, backend, _forced_backend())
    entry = _RESOLVED.get(key)
    if entry is None:
        entry = _RESOLVED[key] = _REGISTRY[(op, device_type)][resolve(op, device_type, backend)]
    return entry


# ---------------------------------------------------------------------------------------------
# the one kernel per (op, dispatch key)
# ---------------------------------------------------------------------------------------------
def _written_arguments(op: str) -> tuple[int, ...]:
    """Positions of the arguments the op writes (``Tensor(a!)`` in its schema)."""
    schema = getattr(torch.ops.latentfast, op).default._schema
    return tuple(i for i, arg in enumerate(schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The [first, last) byte addresses ``t`` can touch."""
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (extent + 1) * t.element_size()


def check_no_overlap(op: str, args, written: tuple[int, ...]) -> None:
    """Refuse outputs whose memory overlaps another output or any input of the call: a kernel
    reading what it already wrote gives wrong results on every backend."""
    labelled = []
    for position, value in enumerate(args):
        for k, tensor in enumerate(_tensors(value)):
            if tensor.numel() and tensor.device.type != "meta":
                name = _ARG_NAMES[op][position] + (f"[{k}]" if isinstance(value, (list, tuple)) else "")
                labelled.append((name, position in written, tensor, _span(tensor)))
    for i, (name, writes, _, (start, end)) in enumerate(labelled):
        if not writes:
            continue
        for j, (other, _, _, (o_start, o_end)) in enumerate(labelled):
            if i != j and start < o_end and o_start < end:
                raise InvalidArgumentError(f"{op}: {name} overlaps {other} in memory; outputs must not alias any other argument")


_ARG_NAMES = {op: [arg.name for arg in getattr(torch.ops.latentfast, op).default._schema.arguments] for op in _ops.SCHEMAS}


def _dispatch_kernel(op: str, device_type: str) -> Callable:
    check = _ops.CHECKS[op]
    written = _written_arguments(op)
    n_kernel_args = len(_ARG_NAMES[op]) - 1

    def kernel(*args, **kwargs):
        # the dispatcher drops a trailing argument equal to its default: no backend means "auto"
        kernel_args, rest = args[:n_kernel_args], args[n_kernel_args:]
        backend = kwargs.get("backend", rest[0] if rest else "auto")
        try:
            fn, checks_arguments = implementation(op, device_type, backend)
            if not checks_arguments:
                check(*kernel_args, backend)
                check_no_overlap(op, kernel_args, written)
            fn(*kernel_args)
        except LatentfastError:
            raise
        except IndexError as exc:
            raise IndexOutOfRangeError(str(exc)) from None
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        except TypeError as exc:
            raise ArgumentTypeError(str(exc)) from None

    kernel.__name__ = f"{op}_{device_type}_dispatch"
    return kernel


for _op in _ops.SCHEMAS:
    for _key, _device_type in (("CPU", "cpu"), ("CUDA", "cuda")):
        _ops.LIB.impl(_op, _dispatch_kernel(_op, _device_type), _key)

from . import compiled, reference, triton_kernels  # noqa: E402,F401  (each registers its kernels)
from .triton_kernels import triton_interpreting, triton_status  # noqa: E402,F401


def _gpu_path(op: str) -> str:
    """What runs ``op`` on CUDA tensors under "auto", whether or not this machine has a GPU."""
    reasons = availability(op, "cuda")
    if not reasons["triton"]:
        return f"Triton kernel (latentfast.kernels.{op.removesuffix('_into')})"
    return f"pure-torch reference ({reasons['triton']})"


def describe(verbose: bool = False) -> str:
    """A human-readable report of what this install can do: the versions, the native library, the
    threads, GPU and Triton, the object storage client and how cold cache reads are done; with
    ``verbose``, the backend each op gets per device (and why the others cannot run it)."""
    import sys

    from .. import __version__

    n_ops = len(_ops.SCHEMAS)
    native_ops = sum(not availability(op, "cpu")["cpp"] for op in _ops.SCHEMAS)
    triton_ops = sum(not availability(op, "cuda")["triton"] for op in _ops.SCHEMAS)
    lines = [
        f"latentfast {__version__} (torch {torch.__version__}, {_torch_build()}; Python {sys.version.split()[0]})",
        f"  native library: {compiled.status()}",
        f"  threads: {torch.get_num_threads()} (torch.get_num_threads(); the native CPU kernels use as many)",
        f"  GPU: {_gpu()}",
        f"  triton: {'importable' if triton_status()[0] else triton_status()[1]}"
        + (" (interpreter mode)" if triton_interpreting() else ""),
        f"  ops (backend auto): CPU tensors get native kernels for {native_ops} of {n_ops}, CUDA tensors Triton kernels "
        f"for {triton_ops} of {n_ops}; the pure-torch reference serves the rest",
        f"  LATENTFAST_BACKEND: {os.environ.get('LATENTFAST_BACKEND') or '(unset: backend auto)'}",
        f"  object storage (s3://, gs://, az:// caches): {_object_storage()}",
        f"  cold cache reads: {_cold_reads()}",
    ]
    if not verbose:
        lines.append("  (the backend of each op per device: latentfast.describe(verbose=True))")
        return "\n".join(lines)
    for op in _ops.SCHEMAS:
        for device_type in DEVICE_TYPES:
            reasons = availability(op, device_type)
            auto = resolve(op, device_type, "auto") if not os.environ.get("LATENTFAST_BACKEND") else "-"
            avail = ", ".join(name for name, why in reasons.items() if not why)
            missing = "; ".join(f"{name}: {why}" for name, why in reasons.items() if why)
            lines.append(f"  {op:<26} {device_type:<5} auto={auto:<7} available=[{avail}]  ({missing})")
    lines.append("  GPU path of each op (CUDA tensors, backend auto):")
    lines += [f"    {op:<26} {_gpu_path(op)}" for op in _ops.SCHEMAS]
    return "\n".join(lines)


def _torch_build() -> str:
    if torch.version.cuda:
        return f"CUDA {torch.version.cuda} build"
    if getattr(torch.version, "hip", None):
        return f"ROCm {torch.version.hip} build"
    return "CPU-only build"


def _gpu() -> str:
    if not torch.cuda.is_available():
        return "none visible" + (" (this torch is a CPU-only build)" if not torch.version.cuda and not getattr(torch.version, "hip", None) else "")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return ", ".join(f"{names.count(name)} x {name}" for name in dict.fromkeys(names))


def _object_storage() -> str:
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("obstore") is None:
        return "no client: obstore is not installed (pip install 'latentfast[s3]')"
    return f"obstore {importlib.metadata.version('obstore')}"


def _cold_reads() -> str:
    from ..cache.feed import coldread

    if not coldread.SUPPORTED:
        return "no parallel I/O on this platform (posix_fadvise is Linux's): rows are read in by page faults"
    return (f"page-cache advice (posix_fadvise WILLNEED) over each batch's missing pages; a pool of "
            f"{coldread.POOL_THREADS} pread threads for files where advice reads synchronously (e.g. FUSE)")


__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "availability",
    "describe",
    "implementation",
    "register_kernel",
    "resolve",
]
