"""Build script for tabed_engine.

`kernels/` is installed as the subpackage `tabed_engine.kernels` (never as a bare
`kernels`, a name that belongs to another PyPI package).
"""
from setuptools import setup

setup(
    name="tabed_engine",
    version="0.1.0",
    description="Speculative decoding engine for vision-language models (TABED ensembles, draft trees)",
    packages=["tabed_engine", "tabed_engine.ops", "tabed_engine.kernels"],
    package_dir={"tabed_engine.kernels": "kernels"},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "transformers>=4.46",
        "safetensors",
        "numpy",
        "pillow",
        "tokenizers",
    ],
    extras_require={
        "triton": ["triton>=3.0"],
        "test": ["pytest", "scipy", "triton>=3.0"],
        "flash": ["flash-attn"],
    },
    entry_points={"console_scripts": ["tabed-engine=tabed_engine.cli:main"]},
)
