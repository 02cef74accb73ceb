"""The native library ``latentfast/_native.so`` (``csrc/``): loaded with ctypes, its kernels called with
data pointers, sizes and strides.

The library links neither libtorch nor libpython (one build serves every torch and every Python); a
kernel takes a flat int64 argument list -- a tensor is ``(data_ptr, dtype, device, dim, *sizes,
*strides)`` (a contiguous 1-D one ``(data_ptr, dtype, device, -1, size)``), a list is its length then
its items -- checks every argument itself before touching
memory, and runs with the GIL released (ctypes releases it for the call). A failed check comes back as
an error code and a message, raised here as ValueError / IndexError / RuntimeError (the dispatch
kernel turns those into the library's errors).

Loading never raises: whatever is wrong with the file (missing, truncated, another architecture,
another ABI version, a missing symbol), :data:`LOAD_ERROR` says what, one warning names it with the
command that fixes it, and every op runs on the pure-torch reference.
"""
from __future__ import annotations

import ctypes
import os
import struct
import sys
import warnings

import torch

ABI_VERSION = 2  # csrc/library.cpp's LATENTFAST_ABI_VERSION
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(PACKAGE_DIR, "_native.so")
ENTRY_POINTS = {  # op -> exported kernel
    "normalize_uint8_into": "latentfast_normalize_uint8_into",
    "gather_rows_into": "latentfast_gather_rows_into",
    "gather_rows_packed_into": "latentfast_gather_rows_packed_into",
    "read_spans_into": "latentfast_read_spans_into",
    "scatter_cotangents_into": "latentfast_scatter_cotangents_into",
    "sample_latents_into": "latentfast_sample_latents_into",
    "gather_rows_multi_into": "latentfast_gather_rows_multi_into",  # sharded caches (see gather_rows_multi_into below)
}
# entry points that are no op's kernel: test hooks, and the samplers' planning passes (feed/sampler.py)
HOOKS = {"sample_latents_philox_words": "latentfast_sample_latents_philox_words",
         "thread_choice_trace": "latentfast_thread_choice_trace",
         "shuffle_like_numpy": "latentfast_shuffle_like_numpy", "group_by_key": "latentfast_group_by_key",
         "sort_segments": "latentfast_sort_segments", "count_keys": "latentfast_count_keys",
         "group_packed": "latentfast_group_packed", "pack_keys": "latentfast_pack_keys"}
# torch's ScalarType numbers (csrc/native.h's Dtype); 99: a dtype no kernel takes
_DTYPES = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4, torch.float16: 5,
           torch.float32: 6, torch.float64: 7, torch.bool: 11, torch.bfloat16: 15}
_ERRORS = {1: ValueError, 2: IndexError, 3: RuntimeError}
_ELF_MACHINES = {3: "x86", 62: "x86_64", 183: "aarch64", 21: "ppc64", 22: "s390x", 243: "riscv"}


def fix_command() -> str:
    """The one command that puts a working library in place for this installation."""
    root = os.path.dirname(PACKAGE_DIR)
    if os.path.exists(os.path.join(root, "setup.py")) and os.path.isdir(os.path.join(root, "csrc")):
        return f"{sys.executable} -m pip install --no-deps -e {root}"  # a source checkout (editable install)
    return f"{sys.executable} -m pip install --force-reinstall --no-deps latentfast"


def _check_elf(path: str) -> str | None:
    """Why ``path`` is not a complete shared library for this machine, or None. Checked before dlopen:
    a truncated file (an interrupted copy or build) can pass dlopen's header checks and then fault
    when its missing pages are touched."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF":
            return f"is not a shared library (no ELF header; {size} bytes)"
        if head[4] != 2 or head[5] != 1:
            return "is not a 64-bit little-endian ELF file"
        machine = struct.unpack_from("<H", head, 18)[0]
        arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(os.uname().machine.lower(), os.uname().machine)
        built_for = _ELF_MACHINES.get(machine, f"ELF machine {machine}")
        if built_for != arch:
            return f"was built for {built_for}, this machine is {arch}"
        phoff, shoff = struct.unpack_from("<QQ", head, 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 54)
        fh.seek(phoff)
        table = fh.read(phentsize * phnum)
    ends = [shoff + shentsize * shnum, phoff + phentsize * phnum]
    if len(table) == phentsize * phnum:
        for k in range(phnum):
            p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", table, k * phentsize)
            if p_type == 1:  # PT_LOAD: its bytes are mapped from the file
                ends.append(p_offset + p_filesz)
    if max(ends) > size:
        return f"is truncated ({size} bytes, its headers need {max(ends)}): a partially written file"
    return None


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """``(library, None)``, or ``(None, why not)``; never raises, whatever the file holds."""
    try:
        return _open()
    except Exception as exc:  # e.g. struct.error on a header of absurd sizes
        return None, f"{PATH} could not be loaded ({type(exc).__name__}: {exc})"


def _open() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("LATENTFAST_DISABLE_C") == "1":
        return None, "LATENTFAST_DISABLE_C=1"
    if not os.path.exists(PATH):
        return None, f"{PATH} is missing (this installation has no compiled kernels)"
    try:
        problem = _check_elf(PATH)
        if problem:
            return None, f"{PATH} {problem}"
        lib = ctypes.CDLL(PATH)
    except OSError as exc:
        return None, f"{PATH} could not be loaded ({exc})"
    try:
        lib.latentfast_abi_version.restype = ctypes.c_int
        version = lib.latentfast_abi_version()
        if version != ABI_VERSION:
            return None, f"{PATH} has ABI version {version}, this latentfast needs {ABI_VERSION} (a stale build)"
        for name in ("latentfast_build_info", "latentfast_last_error", "latentfast_cpu_paths"):
            getattr(lib, name).restype = ctypes.c_char_p
        for name in (*ENTRY_POINTS.values(), *HOOKS.values()):
            fn = getattr(lib, name)
            fn.argtypes = (ctypes.c_char_p, ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64)  # packed int64s, doubles
            fn.restype = ctypes.c_int
    except AttributeError as exc:  # a library of another version of latentfast
        return None, f"{PATH} lacks a symbol ({exc})"
    return lib, None


LIB, LOAD_ERROR = _load()
if LOAD_ERROR is not None and os.environ.get("LATENTFAST_DISABLE_C") != "1":
    warnings.warn(
        f"latentfast: the compiled CPU kernels are off, every op runs on the pure-torch reference: {LOAD_ERROR}. "
        f"Fix: {fix_command()}",
        RuntimeWarning,
        stacklevel=2,
    )


def build_info() -> str:
    return LIB.latentfast_build_info().decode() if LIB is not None else ""


def cpu_paths() -> str:
    return LIB.latentfast_cpu_paths().decode() if LIB is not None else ""


# ---------------------------------------------------------------------------------------------
# calls: descriptors in, error code out
# ---------------------------------------------------------------------------------------------
# The fixed cost of a call is mostly here, in reading tensors' attributes (each a call into torch of
# 0.1-0.2 us; a shape or stride tuple ~0.2-0.3 us): so each is read once, and a contiguous 1-D tensor
# (an index vector, the cache's data) is described without its shape and stride tuples (csrc/native.h's
# kContiguousVector). To add a kernel: its entry point in ENTRY_POINTS, a function below that packs its
# arguments in the order its C++ body reads them. The shape checks are the kernel's own (the op's Python
# checks are skipped for it), so nothing is checked twice.
CONTIGUOUS_VECTOR = -1  # csrc/native.h's kContiguousVector
_STRUCTS: dict[tuple, struct.Struct] = {}  # (kind, count) -> its packer (struct's own cache needs a format string)
_NO_FLOATS = b""


def _tensor(t: torch.Tensor, _dtypes=_DTYPES) -> tuple:
    """``t``'s descriptor: data pointer, dtype, device (0 cpu, 1 cuda, 2 other), then either
    ``CONTIGUOUS_VECTOR, size`` (a contiguous 1-D tensor) or the rank, sizes and strides.
    (``is_cpu``/``is_cuda``: ``t.device.type`` would build a device object, ~5x the time.)"""
    if t.dim() == 1 and t.is_contiguous():
        return (t.data_ptr(), _dtypes.get(t.dtype, 99), 0 if t.is_cpu else 1 if t.is_cuda else 2, CONTIGUOUS_VECTOR,
                t.numel())
    shape = t.shape
    return (t.data_ptr(), _dtypes.get(t.dtype, 99), 0 if t.is_cpu else 1 if t.is_cuda else 2, len(shape), *shape,
            *t.stride())


def _tensor_list(tensors) -> list:
    """A list argument of tensors: its length, then each one's descriptor."""
    args = [len(tensors)]
    for t in tensors:
        args += _tensor(t)
    return args


def _pack(kind: str, values) -> bytes:
    """``values`` as packed int64s (``kind`` "q") or doubles ("d")."""
    packer = _STRUCTS.get((kind, len(values)))
    if packer is None:
        packer = _STRUCTS[kind, len(values)] = struct.Struct(f"{len(values)}{kind}")
    return packer.pack(*values)


def _call(fn, args, floats: bytes = _NO_FLOATS) -> None:
    """Run the kernel ``fn`` (a bound entry point of :data:`ENTRY_POINTS`) on ``args`` (int64s) and
    ``floats`` (packed doubles); ctypes passes the bytes' buffers without a copy and releases the GIL."""
    code = fn(_pack("q", args), len(args), floats, len(floats) // 8)
    if code:
        raise _ERRORS.get(code, RuntimeError)(LIB.latentfast_last_error().decode(errors="replace"))


# entry point name -> its ctypes function, looked up once (a CDLL attribute lookup per call costs too)
_FN = {name: getattr(LIB, name) for name in (*ENTRY_POINTS.values(), *HOOKS.values())} if LIB is not None else {}


def normalize_uint8_into(x, out) -> None:
    args = (*_tensor(x), *_tensor_list(out), torch.get_num_threads())
    _call(_FN["latentfast_normalize_uint8_into"], args)


def gather_rows_into(data, row_offsets, widths, pitch, indices, white, out) -> None:
    flag_white = (0,) if white is None else (1, *_tensor(white))
    args = (*_tensor(data), *_tensor(row_offsets), *_tensor(widths), pitch, *_tensor(indices), *flag_white,
            *_tensor(out), torch.get_num_threads())
    _call(_FN["latentfast_gather_rows_into"], args)


def gather_rows_packed_into(data, row_offsets, widths, pitch, indices, channels, latent_h, out) -> None:
    args = (*_tensor(data), *_tensor(row_offsets), *_tensor(widths), pitch, *_tensor(indices), channels, latent_h,
            *_tensor(out), torch.get_num_threads())
    _call(_FN["latentfast_gather_rows_packed_into"], args)


def read_spans_into(fd, offsets, lengths, threads, out) -> None:
    _call(_FN["latentfast_read_spans_into"], (fd, *_tensor(offsets), *_tensor(lengths), threads, *_tensor(out)))


def scatter_cotangents_into(grads, batch_sizes, scales, arena) -> None:
    args = (*_tensor_list(grads), len(batch_sizes), *batch_sizes, len(scales), *_tensor(arena), torch.get_num_threads())
    _call(_FN["latentfast_scatter_cotangents_into"], args, _pack("d", scales))


def sample_latents_into(mean, std, item_seeds, out) -> None:
    args = (*_tensor(mean), *_tensor(std), *_tensor(item_seeds), *_tensor(out), torch.get_num_threads())
    _call(_FN["latentfast_sample_latents_into"], args)


def sample_latents_philox_words(item_seeds, n: int, *, first_group: int = 0) -> torch.Tensor:
    """int64 ``[B, 4 * ceil(n / 4)]``: the Philox words the C++ sampling kernel draws for ``n`` elements of
    each item from group ``first_group`` on (:func:`latentfast.sampling.philox_words`'s stream; a test hook)."""
    out = torch.empty(item_seeds.shape[0], 4 * ((n + 3) // 4), dtype=torch.int64)
    _call(_FN["latentfast_sample_latents_philox_words"], (*_tensor(item_seeds), first_group, *_tensor(out)))
    return out


def thread_choice_trace(solo_ns: torch.Tensor, pool_ns: torch.Tensor) -> torch.Tensor:
    """int64 ``[n]``: 1 where the gathers' thread choice (csrc/cpu/gather_rows_kernel.cpp's ThreadChoice), fresh,
    took the pool's threads for each of n 2 MiB gathers, gather k costing ``solo_ns[k]`` alone and ``pool_ns[k]``
    with them (int64 ``[n]`` each; a test hook)."""
    out = torch.empty(len(solo_ns), dtype=torch.int64)
    _call(_FN["latentfast_thread_choice_trace"], (*_tensor(solo_ns), *_tensor(pool_ns), *_tensor(out)))
    return out


def gather_rows_multi_into(data, row_sources, row_offsets, widths, pitch, indices, white, out) -> None:
    """The several-source gather of sharded caches (csrc/cpu/gather_rows_multi_kernel.cpp)."""
    flag_white = (0,) if white is None else (1, *_tensor(white))
    args = (*_tensor_list(data), *_tensor(row_sources), *_tensor(row_offsets), *_tensor(widths), pitch,
            *_tensor(indices), *flag_white, *_tensor(out), torch.get_num_threads())
    _call(_FN["latentfast_gather_rows_multi_into"], args)


def shuffle_like_numpy(rng, data) -> None:
    """``rng.shuffle(data)`` of a 1-D int32/int64 tensor, the same draws and result, prefetching
    (csrc/cpu/plan_epoch.cpp); under the generator's lock, as numpy's own shuffle."""
    capsule = rng.bit_generator.capsule
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, (ctypes.py_object, ctypes.c_char_p)
    with rng.bit_generator.lock:
        _call(_FN["latentfast_shuffle_like_numpy"], (get_pointer(capsule, b"BitGenerator"), *_tensor(data)))


def group_by_key(seq, keys, cursor, out) -> None:
    """``out[cursor[keys[v]]++] = v`` for each ``v`` of ``seq`` in order (keys read as unsigned ints of their width)."""
    _call(_FN["latentfast_group_by_key"], (*_tensor(seq), *_tensor(keys), *_tensor(cursor), *_tensor(out)))


def group_packed(packed, cursor, out) -> None:
    """``out[cursor[v >> 32]++] = v & 0xffffffff`` for each ``v`` of ``packed`` (int64) in order."""
    _call(_FN["latentfast_group_packed"], (*_tensor(packed), *_tensor(cursor), *_tensor(out)))


def pack_keys(keys, first: int, packed, counts) -> None:
    """``packed[i] = keys[i] << 32 | (first + i)`` and ``counts[keys[i]] += 1`` (all int64; keys and items < 2^32)."""
    _call(_FN["latentfast_pack_keys"], (*_tensor(keys), first, *_tensor(packed), *_tensor(counts)))


def count_keys(keys, counts) -> None:
    """``counts[k] += 1`` for each ``k`` of ``keys`` (read as unsigned ints of their width)."""
    _call(_FN["latentfast_count_keys"], (*_tensor(keys), *_tensor(counts)))


def sort_segments(items, bounds, ranks, count: int) -> None:
    """Each ``items[bounds[s]:bounds[s + 1]]`` sorted stably by ``ranks[item]`` (< ``count``), in place."""
    _call(_FN["latentfast_sort_segments"], (*_tensor(items), *_tensor(bounds), *_tensor(ranks), count))


KERNELS = {op: globals()[op] for op in ENTRY_POINTS}  # op -> the Python function that calls its kernel
