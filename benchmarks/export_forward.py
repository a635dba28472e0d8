"""Forward time of an exported model (alibi-export-hf, default format) against
the fairseq model it came from, side by side in one run.

    python benchmarks/export_forward.py            # ~3 minutes on 2 CPU cores

A transformer_lm_alibi LM (d=512, 6 layers, 8 heads, FFN 2048, 16K
vocabulary, random weights) is built as fairseq-train builds it, saved,
exported with ``fairseq_alibi.export.export`` and loaded with
``AlibiForCausalLM.from_pretrained``.  For each length, one sequence (batch 1)
runs through both, alternating (fairseq, exported, then exported, fairseq, ...)
under ``torch.inference_mode``; the table has the median seconds of each and
the median of the per-pair ratio exported / fairseq (target: within 1.2x), and
the max |log-prob difference| of the two outputs.  Both run the same kernels
(``kernels.attend``: the chunked, linear-memory kernel at these lengths).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_lm, machine_description, make_dict_dir, median, model_args  # noqa: E402


def export_copy(model, cfg, directory: str):
    """The exported twin of ``model`` (saved, exported, loaded from the directory)."""
    from omegaconf import OmegaConf

    from fairseq_alibi.export import export
    from fairseq_alibi.hf import quiet_transformers
    from fairseq_alibi.core.modeling_alibi import AlibiForCausalLM

    checkpoint = os.path.join(directory, "model.pt")
    torch.save({"cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "model": model.state_dict()},
               checkpoint)
    export(checkpoint, os.path.join(directory, "exported"))
    with quiet_transformers():
        return AlibiForCausalLM.from_pretrained(os.path.join(directory, "exported")).eval()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16000)
    opts = p.parse_args()

    torch.manual_seed(0)
    dims = model_args(opts.embed_dim, opts.layers, opts.heads, 4 * opts.embed_dim, dropout=0.0)
    _, fairseq_model, _, cfg = build_lm("transformer_lm_alibi", make_dict_dir(opts.vocab), dims, 512)
    fairseq_model.eval()
    with tempfile.TemporaryDirectory() as directory:
        exported = export_copy(fairseq_model, cfg, directory)
    print(machine_description())
    print(f"d={opts.embed_dim}, {opts.layers} layers, {opts.heads} heads, vocabulary {opts.vocab}, batch 1, fp32, "
          f"median of {opts.repeats}")
    print("| tokens | fairseq s | exported s | exported / fairseq | max abs log-prob diff |")
    print("|---|---|---|---|---|")
    for length in opts.lengths:
        ids = torch.randint(4, opts.vocab, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.inference_mode():
            ours = exported(input_ids=ids, use_cache=False).logits.log_softmax(-1)
            theirs = fairseq_model.get_normalized_probs(fairseq_model(ids), log_probs=True)
            difference = (ours - theirs).abs().max().item()
            del ours, theirs
            times = {"fairseq": [], "exported": []}
            runs = {"fairseq": lambda: fairseq_model(ids), "exported": lambda: exported(input_ids=ids, use_cache=False)}
            for repeat in range(opts.repeats):
                order = ("fairseq", "exported") if repeat % 2 == 0 else ("exported", "fairseq")
                for name in order:
                    times[name].append(timed(runs[name]))
        ratio = median([e / f for e, f in zip(times["exported"], times["fairseq"])])
        print(f"| {length} | {median(times['fairseq']):.2f} | {median(times['exported']):.2f} | {ratio:.2f} "
              f"| {difference:.1e} |", flush=True)


if __name__ == "__main__":
    main()
