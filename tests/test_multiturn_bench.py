"""benchmarks/multiturn.py --preset tiny on the CPU: both modes run, every later turn reuses the
conversation so far (all but the last answer token of the turn before), the second chat about
the same picture reuses its image, and the tokens equal the uncached engine's."""
import json

from bench_scripts import load_benchmark


def test_multiturn_tiny(tmp_path):
    load_benchmark("multiturn").main(["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path),
                                      "--repeats", "1", "--defer-views"])
    with open(tmp_path / "multiturn_tiny.json") as f:
        rep = json.load(f)
    img_tokens = 4                                            # (28 / 14)^2 patches of the tiny tower
    for mode in ("AR", "SD K=2", "SD K=2 views deferred"):
        r = rep[mode]
        assert "error" not in r, r
        assert r["tokens_equal"] is True
        on, off = r["cache"], r["no cache"]
        assert on["turn 1"]["cached_tokens"] == 0
        for t in (2, 3, 4):
            prev, cur = on[f"turn {t - 1}"], on[f"turn {t}"]
            assert cur["cached_tokens"] == prev["prompt_tokens"] + rep["setup"]["answer"] - 1
            assert off[f"turn {t}"]["cached_tokens"] == 0 and cur["prefill_ms"] > 0
            # the draft's view rows are reused too (speculative turns only)
            assert (cur["draft_cached_tokens"] > 0) == mode.startswith("SD")
        assert on["same image, new chat"]["cached_tokens"] >= 1 + img_tokens     # BOS + the image
    with open(tmp_path / "multiturn_tiny.md") as f:
        assert "| AR | turn 2 |" in f.read()


def test_multiturn_invariant_tiny(tmp_path):
    """`--invariant`: both engines invariant=True, their own results file, tokens equal."""
    load_benchmark("multiturn").main(["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path),
                                      "--repeats", "1", "--invariant"])
    with open(tmp_path / "multiturn_tiny_invariant.json") as f:
        rep = json.load(f)
    assert rep["setup"]["invariant"] is True
    assert all(rep[m]["tokens_equal"] is True for m in ("AR", "SD K=2"))
    assert not (tmp_path / "multiturn_tiny.json").exists()
