"""benchmarks/batch.py --preset tiny on the CPU (every section runs and records what the
results table reads) and the geometric acceptance schedule it drives the engine with."""
import json
import os
import sys

import pytest

from bench_scripts import ROOT, load_benchmark

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


@pytest.mark.parametrize("tau,gamma", [(1.0, 5), (2.31, 5), (4.0, 5), (2.0, 3)])
def test_geometric_schedule(tau, gamma):
    """gamma-chains average tau tokens per block; a shorter chain gets what the same per-draft
    rate gives it (fewer tokens), never more than its depth; the draws repeat."""
    e2e = load_benchmark("e2e")
    f = e2e.geometric_schedule(tau, gamma, seed=3)
    n = 20000
    full = sum(f(b, gamma) for b in range(n)) / n + 1
    assert full == pytest.approx(tau, abs=0.03)
    a = f.alpha
    if a > 0.01:
        short = sum(f(b, 1) for b in range(n)) / n + 1
        assert short == pytest.approx(1 + a, abs=0.02) and short < full
    assert all(0 <= f(b, d) <= d for b in range(200) for d in (1, 2, gamma))
    assert [f(b) for b in range(50)] == [e2e.geometric_schedule(tau, gamma, seed=3)(b) for b in range(50)]


def test_batch_benchmark_tiny(tmp_path):
    load_benchmark("batch").main(["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path), "--max-batch", "4",
                         "--batches", "1", "4", "--taus", "1", "2.31", "--mixed-requests", "4",
                         "--rates", "40", "--prefill-chunks", "0", "9", "--mixed-steps", "0", "1"])
    rep = json.load(open(tmp_path / "batch_tiny.json"))
    assert rep["warmup_s"] > 0 and rep["provenance"]["command"]
    for B in (1, 4):
        row = rep["fixed"][f"B={B}"]
        for key in ("ar", "sd_tau1.0", "sd_tau1.0_always", "sd_tau2.31", "sd_tau2.31_always"):
            r = row[key]
            assert r["tokens_per_s"] > 0 and sum(r["blocks_by_kind"].values()) > 0, (B, key)
        assert set(row["sd_tau2.31_always"]["blocks_by_kind"]) == {"chain5"}     # cost model off: gamma-chains
        assert row["ar"]["blocks_by_kind"] == {"ar": row["ar"]["blocks_by_kind"]["ar"]}
    for mode in ("ar", "sd"):
        for chunk, mixed in ((0, ""), (9, ""), (0, ",mixed_steps"), (9, ",mixed_steps")):
            r = rep["mixed"][f"rate=40,chunk={chunk}{mixed}"][mode]
            assert r["requests"] == 4 and r["prefill_chunk"] == chunk and r["mixed_steps"] == bool(mixed)
            assert r["mixed_steps_run"] == 0 or mixed
            assert 0 < r["prefill_share"] < 1
            assert 0 < r["itl_ms_p50"] <= r["itl_ms_p99"] and 0 < r["step_ms_p50"] <= r["step_ms_p99"]
            assert r["steps"] > 0 and r["ttft_ms_p99"] >= r["ttft_ms_p50"] > 0
            # TTFT splits into the wait before the prefill began and the prefill
            assert 0 < r["prefill_ms_p50"] <= r["prefill_ms_p99"] and r["queued_ms_p50"] <= r["queued_ms_p99"]
        assert rep["sampling"]["B=4"][f"{mode}_mixed_vs_one"] > 0
    # with mixed steps on, chunks of arriving prompts ran inside the running requests' blocks
    assert sum(rep["mixed"]["rate=40,chunk=9,mixed_steps"][m]["mixed_steps_run"] for m in ("ar", "sd")) > 0
