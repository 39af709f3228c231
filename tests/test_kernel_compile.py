"""Every Triton kernel launch compiles for an NVIDIA sm_90 target (no GPU needed).

The CPU interpreter runs programs the compiler rejects (a name re-bound to another shape
inside a loop or a runtime branch); this catches those before a GPU session does. See
tests/compile_kernels.py: launches are recorded under the interpreter, then compiled to
cubin with Triton's CUDA backend in a process without it.
"""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(mode, path, interpret):
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    return subprocess.run([sys.executable, os.path.join(HERE, "compile_kernels.py"), mode, str(path)],
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_every_kernel_launch_compiles_for_sm90(tmp_path):
    path = tmp_path / "launches.json"
    rec = _run("record", path, interpret=True)
    assert rec.returncode == 0, rec.stdout[-3000:] + rec.stderr[-3000:]
    out = _run("compile", path, interpret=False)
    report = out.stdout + out.stderr[-3000:]
    assert out.returncode == 0, report
    # every op's kernels were recorded and compiled (a launcher that stopped launching
    # would shrink the list silently)
    for name in ("_mix_partial_kernel", "_mix_chunk_kernel", "_wd_kl_kernel", "_wd_given_kernel",
                 "_wd_stats_kernel", "_wd_div_kernel", "_argmax_partial_kernel", "_greedy_accept_kernel",
                 "_residual_partial_kernel", "_residual_draw_kernel", "_history_kernel", "_tree_attention_kernel",
                 "_add_rms_norm_kernel", "_rope_kv_write_kernel", "_topk_stats_kernel", "_topk_chunk_kernel",
                 "_tree_start_kernel", "_tree_grow_kernel"):
        assert f"ok   {name}" in out.stdout, name
