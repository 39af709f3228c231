"""Hot ops of the engine: a PyTorch reference per op plus dispatch to its fast path.

Each module here defines `<op>_reference(...)` (plain PyTorch, the ground truth for tests
and the CPU path) and `<op>(...)`, which picks the Triton/CUDA implementation by device
(never by try/except around a failing kernel).
"""
