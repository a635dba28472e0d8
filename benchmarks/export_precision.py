"""Log-prob differences of exported models to the fairseq model, on a trained model.

    python benchmarks/export_precision.py          # ~1 minute on 2 CPU cores

Trains a small BLOOM-shaped LM (``--arch transformer_lm_bloom_alibi``, 2
layers, d=64, 4 heads, tied embeddings, L = 32 tokens, 300 updates) on the
test suite's synthetic corpus with fairseq-train, exports it in both formats,
and prints the max |log-prob difference| (fp32) of each exported model to the
fairseq model on the validation stream, fed as fairseq-eval-lm feeds it
(``</s>`` first), at 4x and 10x L.  The default format runs this package's
kernels (expect 0); BLOOM adds ``slope * j`` over absolute key positions to the
scores (and takes the softmax in fp32), which equals ``-slope * (i - j)`` under
softmax but loses the scores' low bits next to the large biases of far keys,
more so the longer the input; ``hf.apply_alibi_scaling(model, "none")`` gives
the BLOOM model the relative form.  For scale, the first row is the fairseq
model in fp32 against itself in fp64.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from conftest import write_corpus  # noqa: E402

L = 32


def train(work: Path) -> Path:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    run = dict(cwd=work, env=env, check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "fairseq_cli.preprocess", "--only-source", "--trainpref", "train.txt",
                    "--validpref", "valid.txt", "--destdir", "data", "--workers", "1"], **run)
    subprocess.run([sys.executable, "-m", "fairseq_cli.train", "data", "--user-dir", str(ROOT / "fairseq_alibi"),
                    "--task", "language_modeling", "--arch", "transformer_lm_bloom_alibi", "--decoder-layers", "2",
                    "--decoder-embed-dim", "64", "--decoder-attention-heads", "4", "--share-decoder-input-output-embed",
                    "--tokens-per-sample", str(L), "--sample-break-mode", "none", "--batch-size", "8",
                    "--optimizer", "adam", "--lr", "0.005", "--max-update", "300", "--dropout", "0.1", "--seed", "1",
                    "--cpu", "--num-workers", "0", "--save-dir", "ck", "--no-epoch-checkpoints"], **run)
    return work / "ck" / "checkpoint_best.pt"


def main():
    from transformers import BloomForCausalLM

    from fairseq_alibi.export import export
    from fairseq_alibi.export.source import load_source
    from fairseq_alibi import hf
    from fairseq_alibi.hf import quiet_transformers
    from fairseq_alibi.core.modeling_alibi import AlibiForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        work = write_corpus(Path(tmp))
        checkpoint = train(work)
        source = load_source(str(checkpoint), str(work / "data" / "dict.txt"))
        stream = []
        for line in (work / "valid.txt").read_text().splitlines():
            stream += [source.dictionary.index(w) for w in line.split()] + [source.dictionary.eos()]
        inputs = [torch.tensor([[source.dictionary.eos()] + stream[: factor * L - 1]]) for factor in (4, 10)]
        with torch.no_grad():
            expected = [source.model.get_normalized_probs(source.model(ids), log_probs=True) for ids in inputs]
            source.model.double()  # fp32 rounding of the fairseq model itself, for scale
            float64 = [source.model.get_normalized_probs(source.model(ids), log_probs=True) for ids in inputs]
            source.model.float()
        print("| model | 4 x L | 10 x L |")
        print("|---|---|---|")
        print(f"| fairseq fp32 vs fairseq fp64 | {' | '.join(f'{(e - d).abs().max().item():.1e}' for e, d in zip(expected, float64))} |")
        for fmt, cls in (("custom", AlibiForCausalLM), ("bloom", BloomForCausalLM)):
            export(str(checkpoint), str(work / fmt), fmt, dict_path=str(work / "data" / "dict.txt"))
            with quiet_transformers():
                rows = {f"--format {fmt}": cls.from_pretrained(work / fmt).eval()}
                if fmt == "bloom":
                    rows["--format bloom + hf.apply_alibi_scaling(model, 'none')"] = hf.apply_alibi_scaling(
                        cls.from_pretrained(work / fmt).eval(), "none")
            for label, m in rows.items():
                with torch.no_grad():
                    got = [m(input_ids=ids).logits.log_softmax(-1) for ids in inputs]
                print(f"| {label} | {' | '.join(f'{(e - g).abs().max().item():.1e}' for e, g in zip(expected, got))} |")


if __name__ == "__main__":
    main()
