"""The profiling script's summary of an Nsight Compute source page (benchmarks/profile_two_pass.py)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from profile_two_pass import phase_runs  # noqa: E402

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"# Samples","Instructions Executed"')


def _page(name, rows):
    lines = [f'"Kernel Name","{name}",', HEADER]
    lines += [f'"{a:#x}","{src}","{s}","0","{s}","{n}"' for a, src, s, n in rows]
    return "\n".join(lines) + "\n"


def test_phase_runs_split_by_execution_count():
    """Runs of equal execution counts, addresses relative to the kernel's first instruction,
    totals in warp instructions and samples; a second kernel of the page kept apart."""
    base = 0x7F0000001000
    first = [(base, "ATOMG.E.ADD", 3, 12), (base + 0x10, "MOV R1, R2", 1, 12),
             (base + 0x20, "LDG.E.128 R4, [R2]", 9, 48), (base + 0x30, "MUFU.EX2 R5, R5", 4, 48),
             (base + 0x40, "@!P0 BRA 0x7f0000001020", 0, 48), (base + 0x50, "EXIT", 2, 12)]
    second = [(0x2000, "S2R R0, SR_TID.X", 1, 7)]
    got = phase_runs(_page("_k_one", first) + _page("_k_two", second))
    assert [g[0] for g in got] == ["_k_one", "_k_two"]
    name, n_inst, n_samp, runs = got[0]
    assert n_inst == 12 * 3 + 48 * 3 and n_samp == 19
    assert runs == [[0x0, 0x10, 12, 2, 4], [0x20, 0x40, 48, 3, 13], [0x50, 0x50, 12, 1, 2]]
    assert got[1][1:] == (7, 1, [[0, 0, 7, 1, 1]])
