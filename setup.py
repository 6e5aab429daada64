"""Builds torchstrategy and its extension ``torchstrategy._C`` from ``csrc/``.

The C++ sources (``csrc/*.cpp``) always build; ``csrc/bindings.cpp`` registers everything
the others implement. CUDA sources (``csrc/*.cu``) build only when the installed torch has
CUDA and the nvcc found by torch.utils.cpp_extension has the same major version, so a
machine without a GPU toolchain still gets the C++ kernels; TORCHSTRATEGY_WITH_CUDA then
tells bindings.cpp to register the CUDA kernels.

On Linux the extension always links the shared libstdc++ (the one torch itself uses): a
compiler wrapper that links it statically (seen on a GPU machine whose CXX linked with
-static-libstdc++) gives the extension its own copy of the C++ runtime, and an error
raised by one of its ops then crashed the process instead of reaching Python.
"""
import glob
import os
import re
import subprocess
import sys

from setuptools import setup


def _nvcc_matches_torch(torch):
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None or CUDA_HOME is None:
        return False
    try:
        out = subprocess.run([os.path.join(CUDA_HOME, "bin", "nvcc"), "--version"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return False
    found = re.search(r"release (\d+)\.", out)
    return bool(found) and found.group(1) == torch.version.cuda.split(".")[0]


def _extension():
    import torch
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    here = os.path.dirname(os.path.abspath(__file__))
    # The two units that take longest (the Python bindings and the reducer, each through
    # pybind11 and torch's autograd and c10d headers) first: ninja starts units in this
    # order, so on 2 cores they compile side by side and the short ones fill in around
    # them, instead of one long unit starting last.
    longest_first = {"bindings.cpp": 0, "reducer.cpp": 1}
    cpp = sorted(glob.glob(os.path.join(here, "csrc", "*.cpp")),
                 key=lambda p: (longest_first.get(os.path.basename(p), 2), p))
    cuda = sorted(glob.glob(os.path.join(here, "csrc", "*.cu")))
    cpp = [os.path.relpath(p, here) for p in cpp]
    cuda = [os.path.relpath(p, here) for p in cuda]
    cxx_flags = ["-O3"]
    # Named by its soname, so that a -static-libstdc++ the compiler adds on its own cannot
    # pull a private copy in: the symbols resolve to the shared library first.
    link_flags = ["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else []
    if cuda and _nvcc_matches_torch(torch):
        return CUDAExtension("torchstrategy._C", cpp + cuda,
                             define_macros=[("TORCHSTRATEGY_WITH_CUDA", "1")],
                             extra_compile_args={"cxx": cxx_flags,
                                                 "nvcc": ["-O3"]},
                             extra_link_args=link_flags)
    return CppExtension("torchstrategy._C", cpp, extra_compile_args={"cxx": cxx_flags},
                        extra_link_args=link_flags)


def _build_ext():
    from torch.utils.cpp_extension import BuildExtension

    return BuildExtension.with_options(use_ninja=True)


setup(ext_modules=[_extension()], cmdclass={"build_ext": _build_ext()})
