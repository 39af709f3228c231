"""benchmarks/e2e_next.py --preset tiny on the CPU: every section runs (transformers' included)
and writes its fields; the image's token count follows the engine and the processor; the
floor holds the KV read; transformers' LlavaNext greedy tokens equal the engine's in float32."""
import json

import pytest

from bench_scripts import load_benchmark

SECTIONS = ("setup", "bandwidth", "engine_ar", "prefill_split", "ttft", "sd_sweep", "hf_eager")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e_next")
    load_benchmark("e2e_next").main(["--preset", "tiny", "--device", "cpu", "--out", str(out), "--repeats", "1"])
    with open(out / "e2e_tiny.json") as f:
        rep = json.load(f)
    with open(out / "e2e_tiny.md") as f:
        return rep, f.read()


def test_every_section_and_its_fields(report):
    rep, md = report
    assert rep["preset"] == "tiny" and rep["provenance"]["command"]
    for name in SECTIONS:
        assert name in rep and "error" not in rep[name], (name, rep.get(name))
    su = rep["setup"]
    # 56x56 image, 28-px tiles of 7-px patches: 2x2 tiles + base = 16 + 8 * (8 + 1) tokens
    assert su["image_tiles"] == 5 and su["tile_grid"] == [2, 2]
    assert su["image_tokens"] == su["image_tokens_engine_count"] == 88
    assert su["draft_image_tokens"] == 16 and su["prompt_tokens"] == 88 + su["text_tokens"]
    assert rep["targets"]["image_tokens_equal_published"]["pass"] is True

    bw = rep["bandwidth"]
    assert bw["kv_read_bytes_at_mean_context"] == 2 * 2 * 4 * 16 * (su["prompt_tokens"] + 16) * 4
    assert bw["floor_ms_per_token"] > bw["weight_floor_ms_per_token"] > 0

    for K, n_rows in (("K=1", 1), ("K=2", 2)):
        ps = rep["prefill_split"][K]
        assert ps["tiles"] == 5 and all(ps[k] > 0 for k in ("vision_tower_ms", "prefill_target_total_ms",
                                                             "prefill_draft_ms", "draft_host_preprocess_ms"))
        # M row: the draft's own 16 image tokens + the text; T row: the text + one escape token
        assert ps["draft_rows_tokens"] == [16 + su["text_tokens"], su["text_tokens"] + 1][:n_rows]
    tt = rep["ttft"]
    assert not tt["engine_ar"]["speculative"] and tt["engine_sd_K=2"]["speculative"]
    assert all(r["ttft_ms"] > 0 for r in tt.values())

    ar = rep["engine_ar"]["ms_per_token"]
    for K in ("K=1", "K=2"):
        sd = rep["sd_sweep"][K]["tau=2.31"]
        assert sd["sd_over_ar"] == pytest.approx(sd["ms_per_token"] / ar)
        # 32 new tokens: the scheduled 2.31 tokens per block, the last block cut
        assert 2.0 <= sd["tau_realized"] <= 2.31 + 1e-9
    # same target weights in float32: transformers' greedy tokens equal the engine's
    hf = rep["hf_eager"]
    assert hf["greedy_prefix_agreeing_with_engine_ar"] == su["new_tokens"] and hf["ttft_ms"] > 0
    assert "| engine AR |" in md and "transformers LlavaNext AR" in md and "| K=2 |" in md and "TTFT" in md


def test_skip_hf_builds_from_configs(tmp_path):
    """--skip-hf (what the 34B preset needs: one copy of the target's weights) builds target and
    draft from their configs, no transformers model: every engine section runs, the draft takes
    the target's CLIP tower (one image encoding), no transformers section."""
    load_benchmark("e2e_next").main(["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path), "--repeats", "1",
                                     "--skip-hf"])
    with open(tmp_path / "e2e_tiny.json") as f:
        rep = json.load(f)
    for name in SECTIONS[:-1]:
        assert name in rep and "error" not in rep[name], (name, rep.get(name))
    assert "hf_eager" not in rep or not rep["hf_eager"]
    su = rep["setup"]
    assert su["built_from"].startswith("configs") and su["draft_shares_target_vision_weights"] is True
    assert su["image_tokens"] == su["image_tokens_engine_count"] == 88
