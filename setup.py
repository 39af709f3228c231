"""Build script for tabed_engine.

The optional extension `tabed_engine._C` (csrc/) registers the `torch.ops.tabed_engine`
custom ops. It is a CUDAExtension where torch is a CUDA build and nvcc is found, else a
CPU-only CppExtension; `TABED_NO_EXT=1` skips it, and a failed build only warns, so the
package always installs (the ops then fall back to their PyTorch references). Build with
`pip install --no-build-isolation -e .` so that setup.py sees the installed torch.
`TABED_CUDA_ARCHS` (default "90") lists the SM versions to compile for, e.g. "90;100";
PTX of the last one is embedded too.
"""
import os
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _warn(msg):
    print(f"WARNING: tabed_engine._C is not built ({msg}); the ops use their PyTorch "
          "references.", file=sys.stderr)


def _extension_kwargs():
    """`ext_modules` + `cmdclass` for tabed_engine._C, or {} when it is skipped."""
    if os.environ.get("TABED_NO_EXT", "0") == "1":
        return {}
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as exc:  # torch missing (e.g. an isolated build): pure Python
        _warn(f"torch is not importable: {exc}")
        return {}

    class OptionalBuildExtension(cpp_extension.BuildExtension):
        """BuildExtension whose failures (no compiler, compile errors) only warn."""

        def run(self):
            try:
                super().run()
            except Exception as exc:
                _warn(f"build failed: {exc}")

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:
                _warn(f"build of {ext.name} failed: {exc}")

    csrc = os.path.join("csrc")
    cpp_sources = [os.path.join(csrc, f) for f in ("bindings.cpp", "verify_tree_cpu.cpp", "compact_kv.cpp")]
    cu_sources = [os.path.join(csrc, f) for f in ("verify_tree_cuda.cu", "compact_kv_cuda.cu")]
    cuda_home = cpp_extension.CUDA_HOME
    nvcc = shutil.which("nvcc") or (cuda_home and os.path.join(cuda_home, "bin", "nvcc"))
    use_cuda = torch.version.cuda is not None and cuda_home is not None and nvcc and os.path.exists(nvcc)
    if use_cuda:
        archs = [a.strip() for a in os.environ.get("TABED_CUDA_ARCHS", "90").split(";") if a.strip()]
        gencode = []
        for a in archs:
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        gencode += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]  # PTX
        ext = cpp_extension.CUDAExtension(
            "tabed_engine._C",
            cpp_sources + cu_sources,
            include_dirs=[os.path.join(ROOT, csrc)],
            extra_compile_args={"cxx": ["-O3", "-DTABED_WITH_CUDA"],
                                "nvcc": ["-O3", "-DTABED_WITH_CUDA", *gencode]},
        )
    else:
        ext = cpp_extension.CppExtension(
            "tabed_engine._C",
            cpp_sources,
            include_dirs=[os.path.join(ROOT, csrc)],
            extra_compile_args={"cxx": ["-O3"]},
        )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": OptionalBuildExtension}}


setup(
    name="tabed_engine",
    version="0.1.0",
    description="Speculative decoding engine for vision-language models (TABED ensembles, draft trees)",
    packages=["tabed_engine", "tabed_engine.ops", "tabed_engine.kernels"],
    # the bundled demo pair (synthetic world) and its sample image
    package_data={"tabed_engine": ["assets/demo/*", "assets/demo/*/*"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "transformers>=4.57.6",
        "safetensors",
        "numpy",
        "pillow",
        "tokenizers",
    ],
    extras_require={
        "triton": ["triton>=3.0"],
        "serve": ["starlette", "uvicorn"],     # `tabed-engine serve`, the OpenAI-compatible server
        "test": ["pytest", "pytest-xdist", "pytest-benchmark", "scipy", "triton>=3.0", "sentencepiece", "protobuf",
                 "starlette", "uvicorn", "openai", "httpx"],
    },
    entry_points={"console_scripts": ["tabed-engine=tabed_engine.serving.cli:main"]},
    **_extension_kwargs(),
)
