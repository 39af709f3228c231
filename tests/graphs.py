"""CUDA-graph helpers shared by the GPU tests."""
import torch


def replayed(run, replays=3):
    """Capture `run()` in a CUDA graph (its kernels compiled by an earlier call, outside the
    capture), replay the graph `replays` times and wait for it: the captured outputs, as
    the last replay left them."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return out
