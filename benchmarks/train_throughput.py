"""Training throughput (words/s): transformer_lm_alibi against stock transformer_lm.

    python benchmarks/train_throughput.py                          # attention-bound defaults
    python benchmarks/train_throughput.py --attention-dropout 0.1  # the same with attention dropout
    python benchmarks/train_throughput.py --vocab 16384 --layers 4 # vocabulary-bound

Defaults: the attention-bound configuration (6 layers, d=256, 8 heads, FFN 1024,
8 x 512 tokens per update, a 504-word vocabulary, dropout 0.1, attention dropout
0), where the attention layers, not the vocabulary projection, take most of the
time.

Both models are built in one process the way fairseq-train builds them (same
parser, same architecture function, same size flags, input/output dims pinned to
the embedding dim, same pre/post-norm), and trained with fairseq's own
``task.train_step`` (criterion forward, ``optimizer.backward``) followed by a
fairseq Adam step, on the same random batches.  The two models alternate
update by update (A B, then B A, ...): each round times ``--steps`` updates per
model after warm-up, so machine noise hits both alike; the reported ratio is the
median over rounds of ALiBi words/s divided by sinusoidal words/s of the same
round.  Words/s is given both from wall-clock time and from this process's CPU
time (``time.process_time``), which is less disturbed by other jobs on a shared
machine; the two should tell the same story.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_lm, machine_description, make_dict_dir, median, model_args  # noqa: E402


def make_batches(n, batch, length, vocab, pad_idx, eos_idx, padded: bool, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        tokens = torch.randint(4, vocab, (batch, length + 1), generator=gen)
        lengths = torch.full((batch,), length, dtype=torch.long)
        if padded:  # --sample-break-mode eos: right padding to the longest row
            lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
            lengths[0] = length
            for row, n_tok in enumerate(lengths.tolist()):
                tokens[row, n_tok - 1] = eos_idx
                tokens[row, n_tok:] = pad_idx
        src, tgt = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if padded:
            tgt = tgt.masked_fill(src.eq(pad_idx), pad_idx)
        ntokens = int(tgt.ne(pad_idx).sum())
        batches.append({
            "id": torch.arange(batch),
            "nsentences": batch,
            "ntokens": ntokens,
            "net_input": {"src_tokens": src, "src_lengths": lengths},
            "target": tgt,
        })
    return batches


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=504)
    p.add_argument("--embed-dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--length", type=int, default=512, help="tokens per sample")
    p.add_argument("--batch", type=int, default=8, help="sequences per update")
    p.add_argument("--steps", type=int, default=1, help="timed updates per model per round")
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--padded", action="store_true", help="right-padded batches (sample-break-mode eos)")
    p.add_argument("--pre-norm", action="store_true", help="--decoder-normalize-before for both")
    p.add_argument("--attention-dropout", type=float, default=0.0, help="for both models")
    p.add_argument("--alibi-attention", default="auto")
    p.add_argument("--json", help="also write the results here")
    opts = p.parse_args()

    torch.manual_seed(0)
    data_dir = make_dict_dir(opts.vocab)
    common = model_args(opts.embed_dim, opts.layers, opts.heads, opts.ffn)
    common += ["--optimizer", "adam", "--lr", "1e-4", "--attention-dropout", str(opts.attention_dropout)]
    if opts.pre_norm:
        common.append("--decoder-normalize-before")

    from fairseq import optim

    runs = {}
    for name, arch, extra in (
        ("sinusoidal", "transformer_lm", []),
        ("alibi", "transformer_lm_alibi", ["--alibi-attention", opts.alibi_attention]),
    ):
        task, model, criterion, cfg = build_lm(arch, data_dir, common + extra, opts.length)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = optim.build_optimizer(cfg.optimizer, params)
        runs[name] = dict(task=task, model=model, criterion=criterion, optimizer=optimizer,
                          params=sum(p.numel() for p in params), wps=[], cpu_wps=[])

    d = runs["alibi"]["task"].source_dictionary
    batches = make_batches(opts.steps, opts.batch, opts.length, len(d), d.pad(), d.eos(), opts.padded)

    def run_steps(run, n):
        words = 0
        start, cpu_start = time.perf_counter(), time.process_time()
        for i in range(n):
            sample = batches[i % len(batches)]
            loss, sample_size, _ = run["task"].train_step(
                sample, run["model"], run["criterion"], run["optimizer"], update_num=i
            )
            run["optimizer"].multiply_grads(1.0 / max(sample_size, 1))
            run["optimizer"].step()
            run["optimizer"].zero_grad()
            words += sample["ntokens"]
        return words / (time.perf_counter() - start), words / (time.process_time() - cpu_start)

    for run in runs.values():
        run_steps(run, opts.warmup)

    ratios, cpu_ratios = [], []
    for r in range(opts.rounds):
        order = ("sinusoidal", "alibi") if r % 2 == 0 else ("alibi", "sinusoidal")
        wps, cpu = {}, {}
        for name in order:
            wps[name], cpu[name] = run_steps(runs[name], opts.steps)
            runs[name]["wps"].append(wps[name])
            runs[name]["cpu_wps"].append(cpu[name])
        ratios.append(wps["alibi"] / wps["sinusoidal"])
        cpu_ratios.append(cpu["alibi"] / cpu["sinusoidal"])
        print(f"round {r}: sinusoidal {wps['sinusoidal']:.0f} w/s, alibi {wps['alibi']:.0f} w/s, "
              f"ratio {ratios[-1]:.3f} (cpu-time ratio {cpu_ratios[-1]:.3f})", flush=True)

    result = {
        "machine": machine_description(),
        "config": vars(opts),
        "params": {k: v["params"] for k, v in runs.items()},
        "median_wps": {k: median(v["wps"]) for k, v in runs.items()},
        "median_cpu_wps": {k: median(v["cpu_wps"]) for k, v in runs.items()},
        "ratios": ratios,
        "cpu_ratios": cpu_ratios,
        "median_ratio": median(ratios),
        "median_cpu_ratio": median(cpu_ratios),
    }
    print(json.dumps({k: result[k] for k in ("params", "median_wps", "median_cpu_wps")}, indent=1))
    q = sorted(ratios)
    print(f"ALiBi / sinusoidal training words/s, median over {opts.rounds} rounds: "
          f"wall {result['median_ratio']:.3f} (quartiles {q[len(q) // 4]:.3f}..{q[3 * len(q) // 4]:.3f}), "
          f"cpu-time {result['median_cpu_ratio']:.3f}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
