"""benchmarks/e2e_families.py --presets tiny on the CPU: both families' tiny presets run every
section (transformers' included) and write their fields into one JSON and one markdown; the
image token counts follow the processor and the engine; transformers' greedy tokens equal the
engine's in float32 (the same weights through lvlm_from_hf); the SD sweep covers every chain
length with the scheduled acceptance."""
import json

import pytest

from bench_scripts import load_benchmark
from tabed_engine.engine.prefill import DEFER_VIEWS_SHARE

SECTIONS = ("setup", "bandwidth", "engine_ar", "ttft", "sd_gamma", "sd_default", "hf")
PRESETS = ("tiny-onevision", "tiny-qwen2.5-vl")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e_families")
    load_benchmark("e2e_families").main(["--presets", "tiny", "--device", "cpu", "--out", str(out)])
    stem = out / ("e2e_families_" + "_".join(PRESETS))
    with open(f"{stem}.json") as f:
        rep = json.load(f)
    with open(f"{stem}.md") as f:
        return rep, f.read()


@pytest.mark.parametrize("name", PRESETS)
def test_every_section_and_its_fields(report, name):
    rep, md = report
    assert rep["provenance"]["command"] and rep["presets"] == list(PRESETS)
    R = rep["results"][name]
    for sec in SECTIONS:
        assert sec in R and "error" not in R[sec], (sec, R.get(sec))
    su = R["setup"]
    assert su["prompt_tokens"] == su["image_tokens"] + su["text_tokens"] and su["image_tokens"] > 0
    assert not su["draft_shares_target_tower"]          # each model its own tower, as published
    bw = R["bandwidth"]
    assert 0 < bw["floor_ms_per_token"] < bw["floor_with_kv_ms_per_token"]
    assert 0 < bw["draft_over_target_bytes"] < 1
    assert R["engine_ar"]["ratio_to_floor"] == pytest.approx(R["engine_ar"]["ms_per_token"] / bw["floor_ms_per_token"])
    tt = R["ttft"]
    assert not tt["engine_ar"]["speculative"] and tt["engine_sd"]["speculative"]
    assert all(r["ttft_ms"] > 0 and r["time_first_token_of_8_ms"] > 0 for r in tt.values())
    # the draft's views wait for the first block exactly when their rows weigh >= the share
    share = tt["engine_sd"]["views_share"]
    assert tt["engine_sd"]["views_deferred"] is (share >= DEFER_VIEWS_SHARE) and tt["engine_ar"]["views_deferred"] is False

    sg, n = R["sd_gamma"], su["new_tokens"]
    assert [k for k in sg if k.startswith("gamma=")] == [f"gamma={g}" for g in su["gammas"]]
    for g in su["gammas"]:
        r = sg[f"gamma={g}"]
        assert r["draft_step_ms"] > 0 and r["verify_ms"] > 0
        assert ("tau=2.31" in r) == (g >= 2)            # a 1-chain gives at most 2 tokens a block
        if g >= 2:    # the scheduled 2.31 tokens a block, the last block cut
            assert 2.0 <= r["tau=2.31"]["tau_realized"] <= 2.31 + 1e-9
        # a fixed per-draft acceptance: never above the chain's g + 1 tokens a block
        assert 1.0 < r["geometric"]["tau_realized"] <= g + 1
        assert r["geometric"]["blocks"] >= (n - 1) / (g + 1)
        # the bundled world's acceptance (4.06 tokens a 5-chain block): more per block than 2.31's
        assert r["world"]["tau_realized"] <= g + 1 and r["world"]["blocks"] <= r["geometric"]["blocks"]
    assert sg["best_gamma_tau=2.31"]["gamma"] in su["gammas"][1:]
    assert sg["best_gamma_geometric"]["gamma"] in su["gammas"]
    assert sg["best_gamma_world"]["gamma"] in su["gammas"] and sg["world_alpha"] > sg["alpha"]

    sd = R["sd_default"]         # the adaptive engine: its blocks as the cost model picked them
    assert sd["adaptive"] and sd["ms_per_token"] > 0 and sum(sd["blocks_by_kind"].values()) > 0
    assert set(sd["blocks_by_kind"]) <= {"ar"} | {f"chain{g}" for g in range(1, sd["gamma"] + 1)}
    assert "default engine (adaptive" in md

    hf = R["hf"]                 # same weights, float32: transformers' greedy tokens are the engine's
    assert hf["greedy_prefix_agreeing_with_engine_ar"] == n and hf["ttft_ms"] > 0
    assert len(hf["ttft_runs_ms"]) == len(tt["engine_ar"]["ttft_runs_ms"]) == 5    # TTFT: medians of 5 a side
    goals = R["targets"]
    assert goals["engine_ar_le_1.15x_floor"]["value"] == pytest.approx(R["engine_ar"]["ratio_to_floor"])
    assert all(v["value"] is not None for k, v in goals.items() if isinstance(v, dict))
    assert f"### {name}" in md and "| engine AR |" in md and "best γ (geometric)" in md and "| transformers |" in md


def test_a_failing_section_is_recorded(tmp_path, monkeypatch):
    """A section that raises is written as its error; the other sections and presets still run."""
    mod = load_benchmark("e2e_families")

    def boom(self):
        raise RuntimeError("no ttft today")
    monkeypatch.setattr(mod.FamilyBench, "ttft", boom)
    monkeypatch.setattr(mod.FamilyBench, "sd_gamma", lambda self: {"skipped": True})
    mod.main(["--presets", "tiny-qwen2.5-vl", "--device", "cpu", "--out", str(tmp_path), "--skip-hf",
              "--new-tokens", "4", "--repeats", "1"])
    rep = json.load(open(tmp_path / "e2e_families_tiny-qwen2.5-vl.json"))
    R = rep["results"]["tiny-qwen2.5-vl"]
    assert R["ttft"] == {"error": "RuntimeError: no ttft today"}
    assert "error" not in R["engine_ar"] and "hf" not in R
    assert "no ttft today" in open(tmp_path / "e2e_families_tiny-qwen2.5-vl.md").read()
