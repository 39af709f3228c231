"""The benchmarks' read-floor probe (benchmarks/read_floor.py) against its PyTorch reference."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from read_floor import read_probe, read_probe_reference, two_read_probe, two_read_probe_reference  # noqa: E402


@pytest.mark.parametrize("numel,programs,warps,per_thread", [(1, 3, 1, 4), (5003, 7, 1, 8), (70001, 5, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_read_probe_matches_reference(kernel_device, numel, programs, warps, per_thread, dtype):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g).to(dtype).to(kernel_device)
    out = torch.full((programs + 4,), float("nan"), device=kernel_device)
    got = read_probe(x, out, programs, warps, per_thread)
    ref = read_probe_reference(x, programs, warps, per_thread)
    assert got.shape == ref.shape and 1 <= got.numel() <= programs
    torch.testing.assert_close(got.cpu(), ref.cpu(), rtol=1e-5, atol=1e-3)
    assert torch.isnan(out[got.numel():]).all()   # nothing written past the chunks used


def test_read_probe_rejects_bad_buffers(kernel_device):
    x = torch.randn(100, 3, device=kernel_device)
    with pytest.raises(ValueError, match="contiguous"):
        read_probe(x.t(), torch.empty(8, device=kernel_device), 4)
    with pytest.raises(ValueError, match="float32"):
        read_probe(x, torch.empty(8, dtype=torch.float64, device=kernel_device), 4)
    with pytest.raises(ValueError, match="float32"):
        read_probe(torch.randn(5000, device=kernel_device), torch.empty(2, device=kernel_device), 4, 1, 8)


@pytest.mark.parametrize("groups,group_len,task_len,warps,per_thread", [
    (1, 1000, 5000, 1, 4), (3, 5003, 1024, 1, 8), (7, 2611, 700, 2, 4), (2, 40000, 9000, 4, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_read_probe_reads_every_task_twice(kernel_device, groups, group_len, task_len, warps, per_thread, dtype):
    g = torch.Generator().manual_seed(group_len)
    x = (torch.randn(groups * group_len, generator=g) + 0.25).to(dtype).to(kernel_device)
    ref = two_read_probe_reference(x, group_len, task_len, warps, per_thread)
    out = torch.full((2 * ref.shape[0] + 6,), float("nan"), device=kernel_device)
    for _ in range(2):   # the counters are left zero for the next launch
        got = two_read_probe(x, out, group_len, task_len, warps, per_thread)
        assert got.shape == ref.shape and ref.shape[0] >= groups
        torch.testing.assert_close(got.cpu(), ref.cpu(), rtol=1e-5, atol=1e-3)
    assert torch.isnan(out[got.numel():]).all()


def test_two_read_probe_rejects_bad_input(kernel_device):
    x = torch.randn(100, 3, device=kernel_device)
    with pytest.raises(ValueError, match="contiguous"):
        two_read_probe(x.t(), torch.empty(8, device=kernel_device), 30, 10)
    with pytest.raises(ValueError, match="whole groups"):
        two_read_probe(x, torch.empty(600, device=kernel_device), 7, 10)
    with pytest.raises(ValueError, match="float32"):
        two_read_probe(x, torch.empty(600, dtype=torch.float64, device=kernel_device), 30, 10)
    with pytest.raises(ValueError, match="float32"):
        two_read_probe(x, torch.empty(5, device=kernel_device), 30, 10)
