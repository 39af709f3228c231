"""Hot ops of the engine: a PyTorch reference per op plus dispatch to its fast path.

Each module here defines `<op>_reference(...)` (plain PyTorch, the ground truth for tests
and the CPU path) and `<op>(...)`, which picks the implementation by device: CUDA tensors
run the fast kernel (a Triton import error surfaces there), other devices the reference.
Never by try/except around an import or a failing kernel. Tests run a Triton kernel on the
CPU (TRITON_INTERPRET=1) by calling its launcher in `tabed_engine.kernels` directly.
"""
