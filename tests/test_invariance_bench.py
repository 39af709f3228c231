"""benchmarks/invariance.py --preset tiny on the CPU: both paths run and record what the results
table reads."""
import json

from bench_scripts import load_benchmark


def test_invariance_benchmark_tiny(tmp_path):
    load_benchmark("invariance").main(["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path),
                                       "--requests", "3", "--new-tokens", "5", "--timed-tokens", "4",
                                       "--batches", "2", "--timed-batches", "1"])
    rep = json.load(open(tmp_path / "invariance_tiny.json"))
    assert rep["provenance"]["command"] and set(rep["paths"]) == {"default", "invariant"}
    for path in rep["paths"].values():
        for key in ("alone_sd", "batch2_ar", "batch2_sd"):
            assert path[key]["of"] == 3 and 0 <= path[key]["equal"] <= 3
            assert len(path[key]["first_diff"]) == 3 - path[key]["equal"]
        assert path["speed"]["ttft_ms_median_alone_ar"] > 0
        assert path["speed"]["ar_B1_ms_per_token"] > 0 and path["speed"]["sd_tau2.31_B1_ms_per_token"] > 0
    assert set(rep["cost"]) == {"ar_B1_ms_per_token", "sd_tau2.31_B1_ms_per_token", "ttft_ms_median_alone_ar"}


def test_invariance_benchmark_one_path_one_section(tmp_path):
    """--paths / --sections / --tag: a run split over calls writes its own file, no cost line."""
    load_benchmark("invariance").main(["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path),
                                       "--requests", "2", "--new-tokens", "3", "--batches", "2",
                                       "--paths", "invariant", "--sections", "equality", "--tag", "_eq"])
    rep = json.load(open(tmp_path / "invariance_tiny_eq.json"))
    assert set(rep["paths"]) == {"invariant"} and "cost" not in rep
    assert "speed" not in rep["paths"]["invariant"] and rep["paths"]["invariant"]["alone_sd"]["of"] == 2
