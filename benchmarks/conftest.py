"""pytest set-up of the kernel microbenchmarks: `pytest benchmarks/ --benchmark-only` on a GPU.

Files `bench_*.py` that define `test_*` functions are collected (the other `bench_*.py`
files are standalone scripts). Without a CUDA device every benchmark is skipped.
"""
import pytest
import torch

from _common import copy_bandwidth_gbs, graph_ms


def pytest_collect_file(file_path, parent):
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and "\ndef test_" in file_path.read_text()):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="kernel benchmarks need a CUDA GPU")
    for item in items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def copy_gbs():
    """Device-to-device copy bandwidth of this run (256 MB: past L2), GB/s: the ceiling every
    benchmark reports itself against."""
    return copy_bandwidth_gbs("cuda", 256 << 20)


@pytest.fixture
def bench(benchmark, copy_gbs):
    """bench(fn, nbytes, flops=0): time fn() as the engine runs it, `inner` calls replayed from
    one CUDA graph per round, and record in benchmark.extra_info the microseconds per call,
    the bytes it must move, the achieved GB/s (TFLOP/s when flops are given) and the copy
    ceiling measured in the same run."""
    def run(fn, nbytes, flops=0, inner=20, rounds=20):
        graph_ms(fn, inner, reps=1)                 # compile and warm up outside the timed rounds
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()

        def replay():
            graph.replay()
            torch.cuda.synchronize()

        benchmark.pedantic(replay, rounds=rounds, iterations=1, warmup_rounds=2)
        us = benchmark.stats.stats.median / inner * 1e6
        info = benchmark.extra_info
        info.update(us_per_call=us, bytes=nbytes, gbps=nbytes / us / 1e3, copy_gbps=copy_gbs,
                    pct_of_copy=100 * nbytes / us / 1e3 / copy_gbs, inner=inner)
        if flops:
            info["tflops"] = flops / us / 1e6
        return info
    return run
