"""The extension builds and registers its ops here; the C++ core's unit tests pass when
compiled with plain g++; the CUDA sources compile with nvcc (-c only, no GPU needed)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tabed_engine.ops import _ext

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


@pytest.mark.skipif(os.environ.get("TABED_NO_EXT") == "1", reason="TABED_NO_EXT=1: extension skipped on purpose")
def test_extension_loaded_and_ops_registered():
    assert _ext.HAS_EXT, ("tabed_engine._C did not import; build it with "
                          f"`pip install --no-build-isolation -e .` ({_ext.EXT_ERROR})")
    assert _ext.HAS_CPU_KERNELS
    schema = str(torch.ops.tabed_engine.verify_tree.default._schema)
    assert schema.startswith("tabed_engine::verify_tree(Tensor tokens, Tensor parents, Tensor p, Tensor? q, "
                             "Tensor? uniforms, bool greedy) -> (Tensor path, Tensor num_accepted"), schema
    schema = str(torch.ops.tabed_engine.compact_kv.default._schema)
    assert "Tensor(a!) k_cache, Tensor(b!) v_cache" in schema and schema.endswith("-> ()"), schema
    for op in ("verify_tree", "compact_kv"):
        for key in ("CPU", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"tabed_engine::{op}", key), (op, key)
    if torch.cuda.is_available() and torch.version.cuda:
        assert _ext.HAS_CUDA_KERNELS, "CUDA torch and GPU present but _C was built without CUDA kernels"


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.parametrize("name,core", [("verify_tree", "verify_tree_cpu.cpp"), ("compact_kv", "compact_kv.cpp")])
def test_core_unit_tests_with_plain_cxx(tmp_path, name, core):
    # The core compiles without torch and without CUDA (TABED_HD -> inline).
    exe = tmp_path / f"test_{name}"
    subprocess.run([CXX, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{CSRC}",
                    str(CSRC / "tests" / f"test_{name}.cpp"), str(CSRC / core), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 failure(s)" in run.stdout


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_cuda_sources_compile(tmp_path):
    # Compile only (no GPU here): both .cu files for sm_90 + PTX, in parallel.
    procs = []
    for cu in sorted(CSRC.glob("*.cu")):
        cmd = [NVCC, "-std=c++17", "-O3", "-c", "-DTABED_WITH_CUDA", f"-I{CSRC}",
               "-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90",
               "-Werror", "all-warnings", str(cu), "-o", str(tmp_path / (cu.stem + ".o"))]
        procs.append((cu.name, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    assert len(procs) == 2
    for name, proc in procs:
        out, _ = proc.communicate(timeout=110)
        assert proc.returncode == 0, f"{name}:\n{out}"


def test_no_top_level_package_shadows_an_installed_one():
    """Nothing at the repository root (on sys.path under pytest, and for `python -m` run from a
    checkout) is importable under a name another distribution owns: transformers >= 5.25 depends on
    the PyPI package `kernels` and imports it at start-up, so a root `kernels/` broke every import."""
    import importlib.metadata

    owned = set(importlib.metadata.packages_distributions())
    ours = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    ours |= {p.stem for p in ROOT.glob("*.py")}
    assert ours & owned <= {"tabed_engine", "setup"}, sorted(ours & owned)
    assert "kernels" not in ours
