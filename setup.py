"""Build latentfast._C: the CPU kernels always, the CUDA kernels when torch and a toolkit allow.

A GPU is never needed to compile. Environment knobs:
  LATENTFAST_BUILD_CUDA=0|1   force the CUDA sources off/on (default: on when torch.version.cuda
                              is set and nvcc is found)
  TORCH_CUDA_ARCH_LIST        respected; default "8.0;9.0" (Ampere + Hopper)
  MAX_JOBS                    parallel compile jobs (ninja)
"""
import glob
import json
import os
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _pip_cuda_include_dirs():
    """Headers shipped by pip's nvidia-* wheels (e.g. cusparse.h under nvidia/cu13/include)."""
    dirs = []
    for entry in sys.path:
        for pattern in ("nvidia/cu*/include", "nvidia/*/include"):
            dirs.extend(sorted(glob.glob(os.path.join(entry, pattern))))
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def _locate_cuda_home():
    """torch derives CUDA_HOME from the nvcc on PATH, which may be a wrapper script or a link
    outside the toolkit (e.g. /usr/local/bin/nvcc -> CUDA_HOME=/usr/local, no libcudart there).
    Pick the first candidate that really is a toolkit."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if os.path.exists(os.path.join(home, "bin", "nvcc")) and os.path.exists(
            os.path.join(home, "include", "cuda_runtime.h")
        ):
            os.environ["CUDA_HOME"] = home
            return


def _write_build_info(torch, build_cuda: bool, reason: str, cuda_home) -> str:
    """Print the resolved configuration and compile it into _C (``latentfast.describe()`` shows it:
    pip hides a build's output unless asked with -v). Returns the folder of the generated header."""
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "-") if build_cuda else "-"
    info = (
        f"torch {torch.__version__} (cuda {torch.version.cuda}); CUDA kernels: {'yes' if build_cuda else 'no'} "
        f"({reason}); CUDA_HOME: {cuda_home}; TORCH_CUDA_ARCH_LIST: {arch}"
    )
    print(f"latentfast build configuration: {info}", flush=True)
    folder = os.path.join(ROOT, "build", "latentfast_generated")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "latentfast_build_info.h"), "w") as fh:
        fh.write(f"#define LATENTFAST_BUILD_INFO {json.dumps(info)}\n")
    return folder


def _extension():
    _locate_cuda_home()
    import torch
    from torch.utils import cpp_extension

    cuda_env = os.environ.get("LATENTFAST_BUILD_CUDA")
    nvcc_found = cpp_extension.CUDA_HOME is not None and os.path.exists(
        os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
    )
    if cuda_env in ("0", "1"):
        build_cuda = cuda_env == "1"
        reason = f"LATENTFAST_BUILD_CUDA={cuda_env}"
    else:
        build_cuda = bool(torch.version.cuda) and nvcc_found
        reason = f"torch.version.cuda={torch.version.cuda}, nvcc found={nvcc_found}"
    if build_cuda and not nvcc_found:
        raise RuntimeError("LATENTFAST_BUILD_CUDA=1 but no CUDA toolkit (CUDA_HOME/nvcc) was found")
    if build_cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"

    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
    extra = {"cxx": ["-O3", *openmp]}  # the C++ standard is the one torch's headers ask for
    include_dirs = [os.path.join(ROOT, "csrc"), _write_build_info(torch, build_cuda, reason, cpp_extension.CUDA_HOME)]
    if build_cuda:
        sources += cuda_sources
        extra["nvcc"] = ["-O3", "--use_fast_math", "-lineinfo"]
        include_dirs += _pip_cuda_include_dirs()
        ext_cls = cpp_extension.CUDAExtension
    else:
        ext_cls = cpp_extension.CppExtension
    return ext_cls(
        name="latentfast._C",
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args=extra,
        extra_link_args=openmp,
        py_limited_api=False,
    ), cpp_extension.BuildExtension


ext, build_ext = _extension()
setup(
    ext_modules=[ext],
    cmdclass={"build_ext": build_ext.with_options(use_ninja=True)},
)
