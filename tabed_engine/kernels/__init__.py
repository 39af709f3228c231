"""Triton kernels of tabed_engine, one module per op (installed as `tabed_engine.kernels`).

Each module holds a `@triton.jit` kernel and a launcher that checks shapes and strides,
allocates the outputs and launches. The PyTorch references live in `tabed_engine.ops`.
"""
