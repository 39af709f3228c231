"""The benchmark scripts under benchmarks/ as modules, for their CPU smoke tests."""
import importlib.util
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def load_benchmark(name: str):
    """benchmarks/<name>.py imported as module `bench_<name>` (registered in sys.modules:
    dataclasses look their module up while the file executes)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
