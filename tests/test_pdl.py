"""Programmatic dependent launch (tabed_engine/kernels/_common.py): when it is on, and that it changes no
result: a decoder forward (one-row and six-row decode paths, all Triton launchers) gives
bit-identical logits with PDL on and off."""
import pytest
import torch

from tabed_engine.kernels import _common


def test_pdl_is_off_off_cuda():
    assert _common.pdl("cpu") is False
    assert _common.pdl(torch.device("cpu")) is False


@pytest.mark.gpu
def test_pdl_switch(monkeypatch):
    dev = torch.device("cuda")
    monkeypatch.delenv("TABED_PDL", raising=False)
    on = _common.pdl(dev)
    assert on == (torch.cuda.get_device_capability(dev)[0] >= 9 and hasattr(_common.tl.extra.cuda, "gdc_wait"))
    monkeypatch.setenv("TABED_PDL", "0")     # the A/B switch wins over the cached capability
    assert _common.pdl(dev) is False
    monkeypatch.setenv("TABED_PDL", "1")
    assert _common.pdl(dev) is on


@pytest.mark.gpu
def test_pdl_on_and_off_give_identical_logits(monkeypatch):
    from tabed_engine.models.config import LMConfig
    from tabed_engine.models.decoder import KVCache, LlamaLM

    dev = torch.device("cuda")
    cfg = LMConfig(vocab_size=1000, hidden_size=512, intermediate_size=1536, num_layers=2, num_heads=8,
                   num_kv_heads=4, head_dim=64)   # >= ops.gemv.MIN_FEATURES: the Triton GEMVs run
    torch.manual_seed(0)
    lm = LlamaLM(cfg).to(device=dev, dtype=torch.bfloat16)
    for p in lm.parameters():
        torch.nn.init.normal_(p, std=0.05)
    monkeypatch.delenv("TABED_PDL", raising=False)
    if torch.cuda.get_device_capability(dev)[0] >= 9:   # Hopper + a Triton with griddepcontrol
        assert _common.pdl(dev)
    for rows, T in ((1, 1), (1, 6), (3, 1)):
        cache = KVCache(cfg, rows, 256, dev, torch.bfloat16)
        cache.lengths.fill_(37)
        ids = torch.randint(0, cfg.vocab_size, (rows, T), device=dev)
        pos = cache.lengths.long()[:, None] + torch.arange(T, device=dev)
        out = {}
        for flag in ("0", "1"):
            monkeypatch.setenv("TABED_PDL", flag)
            with torch.inference_mode():
                out[flag] = lm(cache, pos, input_ids=ids)
        assert not out["1"].isnan().any()
        assert torch.equal(out["0"], out["1"]), f"rows={rows} T={T}: PDL changed the logits"
