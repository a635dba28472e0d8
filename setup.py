from setuptools import find_packages, setup

setup(
    name="fairseq-alibi",
    version="0.1.0",
    description="ALiBi (Attention with Linear Biases) models for fairseq, as a plugin",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["fairseq_alibi", "fairseq_alibi.*"]),
    py_modules=["alibi_user_dir"],
    python_requires=">=3.9",
    # fairseq itself (fairseq-fixed on Python 3.11) and torch are installed by
    # `make install`: fairseq's pinned torchaudio would replace a CPU torch.
    install_requires=["hydra-core>=1.3", "omegaconf>=2.3", "sacremoses", "matplotlib", "tqdm"],
    extras_require={"test": ["pytest"]},
    entry_points={
        "console_scripts": [
            "alibi-train = fairseq_alibi.cli:train",
            "alibi-eval-lm = fairseq_alibi.cli:eval_lm",
            "alibi-generate = fairseq_alibi.cli:generate",
            "alibi-interactive = fairseq_alibi.cli:interactive",
            "alibi-hydra-train = fairseq_alibi.cli:hydra_train",
            "alibi-preprocess = fairseq_alibi.cli:preprocess",
            "alibi-user-dir = alibi_user_dir:main",
            "alibi-sweep = fairseq_alibi.evaluation.perplexity:main",
            "alibi-retrieval = fairseq_alibi.evaluation.retrieval:main",
            "alibi-convert-checkpoint = fairseq_alibi.cli:convert_checkpoint",
            "alibi-export-hf = fairseq_alibi.cli:export_hf",
        ]
    },
)
