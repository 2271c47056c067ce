"""megatron-triroute: distributed training of TriRoute transformers on Megatron-Core + DeepSpeed-MoE."""

from setuptools import find_packages, setup

setup(
    name="megatron-triroute",
    version="0.1.0",
    description="Joint attention / expert / KV-precision routing (TriRoute) on Megatron-Core and DeepSpeed-MoE",
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["megatron_triroute", "megatron_triroute.*", "data_prep", "data_prep.*"])
    + ["triroute_kernels"],
    # `kernels/` installs as `triroute_kernels` so it never shadows another package's `kernels`.
    package_dir={"triroute_kernels": "kernels"},
    install_requires=[
        # torch: a range that admits a newer release pulls a multi-GB CUDA build on CPU machines;
        # constraints.txt pins the exact CPU wheel CI uses.
        "torch>=2.4,<=2.14.1",
        "megatron-core>=0.16.1,<0.20",
        "deepspeed>=0.19.8,<0.20",
        "sentencepiece>=0.2,<0.3",
        "tensorboard>=2.16,<3",
        "safetensors>=0.4",
        "zstandard>=0.22",
        "mpi4py>=3.1",
        "numpy>=1.26",
        "pyarrow>=14",
        "ninja>=1.11",  # torch.utils.cpp_extension builds the C++ CPU decode kernels with it
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.3", "triton>=3.0"],  # Triton kernels run interpreted on CPU
        # GPU-cluster accelerations, imported behind guards; never required on CPU.
        # NVIDIA apex is not on PyPI: build it from its repository on the cluster.
        "gpu": ["transformer-engine[pytorch]>=1.12", "triton>=3.0"],
        # lm-evaluation-harness model `triroute` (megatron_triroute.evaluation.harness); the exact
        # version and everything it pulls are pinned in constraints.txt.
        "eval": ["lm-eval>=0.4.13,<0.5", "accelerate>=1.0"],  # accelerate: the harness's own `hf` model
        # Routing-analysis figures (python -m megatron_triroute.analyze).
        "analysis": ["matplotlib>=3.8"],
        # Export to / import from Hugging Face format (python -m megatron_triroute.export).
        "hf": ["transformers>=5.23,<6", "tokenizers>=0.23"],
    },
    # The exported modeling code's templates (copied into each export directory); the C++ CPU
    # kernels' source (JIT-built on first use, triroute_kernels.cpu_ops).
    package_data={"megatron_triroute.export": ["hf_code/*.py"], "triroute_kernels": ["csrc/*.cpp", "csrc/*.h"]},
    entry_points={
        "console_scripts": [
            "triroute-data-prep=data_prep.__main__:main",
            "triroute-train=megatron_triroute.train:cli",
            "triroute-evaluate=megatron_triroute.evaluate:main",
            "triroute-export=megatron_triroute.export.__main__:cli",
        ]
    },
)
