"""Build latentfast/_native.so: the CPU kernels as one plain shared library (C ABI, loaded with ctypes).

It links neither libtorch nor libc10 nor libpython, so the build needs no torch (pip's isolated build
installs setuptools only) and one build serves every torch >= 2.4 and every CPython >= 3.10: the wheel
is tagged py3-none-<platform>. The GPU kernels are Triton (latentfast/kernels/), compiled at run time against the
CUDA the user's torch brings, so nothing here needs nvcc.

Environment knobs:
  CXX                        the compiler (default: the one Python was built with, usually g++)
  LATENTFAST_NATIVE_FLAGS    extra compile flags, e.g. "-march=native" for a local build
"""
import os
import platform
import shlex
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["csrc/library.cpp", "csrc/thread_pool.cpp"] + sorted(
    os.path.join("csrc", "cpu", name) for name in os.listdir(os.path.join(ROOT, "csrc", "cpu")) if name.endswith(".cpp")
)
# -fvisibility=hidden: only the latentfast_* entry points are exported; the C++ runtime is linked
# statically on Linux, so the library needs only the build host's glibc (auditwheel: manylinux_<that glibc>)
COMPILE = ["-std=c++17", "-O3", "-fvisibility=hidden", "-fno-math-errno", "-pthread"]
LINK = ["-pthread"]
if sys.platform.startswith("linux"):  # GNU ld: the C++ runtime inside, no debug symbols (4 MB -> 1.5 MB)
    LINK += ["-static-libstdc++", "-static-libgcc", "-s"]


def _compiler_version(compiler: list[str]) -> str:
    try:
        out = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        return out.splitlines()[0].strip() if out else compiler[0]
    except (OSError, subprocess.SubprocessError):
        return compiler[0]


class BuildNative(build_ext):
    """Builds the one library as latentfast/_native.so (no Python ABI tag: it is not a Python module)."""

    def get_ext_filename(self, fullname):
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extension(self, ext):
        extra = shlex.split(os.environ.get("LATENTFAST_NATIVE_FLAGS", ""))
        info = (
            f"{_compiler_version(getattr(self.compiler, 'compiler_so', ['c++'])[:1])}; {platform.machine()}; flags "
            f"{' '.join(COMPILE + extra)}; CPU kernels only (GPU kernels: Triton)"
        )
        print(f"latentfast native build: {info}", flush=True)
        ext.define_macros = [("LATENTFAST_BUILD_INFO", '"' + info.replace('"', "'") + '"')]
        ext.extra_compile_args = COMPILE + extra
        super().build_extension(ext)


class PlatformWheel(bdist_wheel):
    """py3-none-<platform>: the library does not depend on the Python version or ABI."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


# Every package under latentfast/ (the Triton kernels and the benchmark suites included). Nothing at the
# checkout's top level is a package: a folder there would shadow a user's package of the same name.
PACKAGES = find_packages(ROOT, include=["latentfast", "latentfast.*"])

setup(
    packages=PACKAGES,
    ext_modules=[
        Extension("latentfast._native", sources=SOURCES, include_dirs=[os.path.join(ROOT, "csrc")],
                  extra_link_args=LINK, language="c++")
    ],
    cmdclass={"build_ext": BuildNative, "bdist_wheel": PlatformWheel},
)
