"""Package metadata for specdec_kernels (the one place it lives).

The repository folder ``kernels/`` holds the Triton kernels. It is installed as
the subpackage ``specdec_kernels.kernels`` (never as a top-level ``kernels``
module: another PyPI distribution owns that import name).
"""

from pathlib import Path

from setuptools import setup

HERE = Path(__file__).parent

setup(
    name="specdec_kernels",
    version="0.1.0",
    description="Fused Triton kernels and a PyTorch API for fast, lossless speculative decoding",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=["specdec_kernels", "specdec_kernels.reference", "specdec_kernels.kernels"],
    package_dir={"specdec_kernels.kernels": "kernels"},
    # trained draft heads (load_smollm2_draft); the C sources built at first use (specdec_kernels._native)
    package_data={"specdec_kernels": ["heads/*.pt", "panels.c", "attention.c"]},
    install_requires=[
        "torch>=2.4",  # F.rms_norm
        "einops>=0.7",
        # Triton wheels exist for Linux only; elsewhere the CPU paths still run.
        "triton>=3.0; platform_system == 'Linux'",
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-benchmark>=4", "hypothesis>=6", "scipy>=1.10", "ruff>=0.5"],
        "hf": ["transformers>=4.45", "gguf>=0.10", "accelerate>=0.30", "safetensors>=0.4"],
    },
    entry_points={"console_scripts": ["specdec-kernels=specdec_kernels.__main__:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
