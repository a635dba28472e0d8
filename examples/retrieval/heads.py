"""Which heads retrieve, and what their ALiBi bias does to them past the training length.

For ``lines`` prompts of each given length, the attention of the position that
predicts the answer's first digit is recomputed by hand in every layer and head
(queries and keys from the model's own projections, ``q.k / sqrt(d)`` plus the
head's bias ``-m * distance`` with the slopes the chosen method gives at that
length, the distance capped at ``C`` for ``cap``) and the attention mass on the
queried record's tokens is averaged over the prompts.  Printed: a row per (layer, head) with its slope, the mass at each
length, and the bias it puts on the record at the longest length.

    python examples/retrieval/heads.py DATA CHECKPOINT --digits 3 --lengths 128,1024 \
        --methods none,linear:2,ntk:8,cap
"""

from __future__ import annotations

import argparse
import math
import random

import torch

from key_heads import inputs_ok, load_model  # (this directory: the script's own)


@torch.no_grad()  # analysis only: no autograd graph for the hand-computed scores
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data")
    p.add_argument("checkpoint")
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--lengths", default="128,1024")
    p.add_argument("--methods", default="none")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--top", type=int, default=0,
                   help="print only the K heads with the most mass at the first length (default: all)")
    args = p.parse_args(argv)
    if not inputs_ok(args.data, [args.checkpoint]):
        return 1

    from fairseq_alibi.core import alibi
    from fairseq_alibi.evaluation import prompts as P
    from fairseq_alibi.evaluation.axes import parse_methods

    lengths = [int(x) for x in args.lengths.split(",")]
    for method in parse_methods(args.methods):
        model = load_model("the checkpoint", args.checkpoint, args.data, method.config_values())
        if model is None:
            return 1
        d = model.decoder.dictionary
        vocab = P.Vocabulary([d[i] for i in range(d.nspecial, len(d))])
        task = P.Lines(vocab, digits=args.digits)
        layers = model.decoder.layers
        heads = layers[0].self_attn.num_heads
        bias = model.decoder.positions  # the stack's bias under this method
        base = bias.base_slopes
        captured = {}

        def hook(index):
            def fn(module, args, kwargs):
                captured[index] = (args[0] if args else kwargs["query"]).detach()
            return fn

        handles = [layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True)
                   for i, layer in enumerate(layers)]
        mass = {n: torch.zeros(len(layers), heads) for n in lengths}
        far_bias = {}
        digit_hits = {}
        for n in lengths:
            distances = []
            for s in range(args.samples):
                rng = random.Random(f"{args.seed}:heads:{n}:{s}")
                prompt = task.build(n, rng.randrange(5), 5, rng)
                ids = [d.eos()] + [d.index(w) for w in prompt.prompt] + [d.index(w) for w in prompt.answer[:-1]]
                tokens = torch.tensor([ids])
                slopes = bias.slopes(len(ids))  # a forward over len(ids) keys (dynamic methods depend on it)
                logits, _ = model(tokens)
                answer = torch.tensor([d.index(w) for w in prompt.answer])
                pos = len(prompt.prompt)
                hits = logits[0, pos:pos + len(answer)].argmax(-1) == answer
                digit_hits.setdefault(n, torch.zeros(len(answer) + 1))
                digit_hits[n] += torch.cat([hits.float(), hits.all().float()[None]]) / args.samples
                line_len = len(task.record("k", prompt.answer))
                start = 1 + prompt.meta["needle_offset"]  # +1: the prepended eos
                span = slice(start, start + line_len)
                qpos = len(prompt.prompt)  # input position predicting the answer's first token
                distances.append(qpos - start)
                for li, layer in enumerate(layers):
                    attn = layer.self_attn
                    x = captured[li][:, 0]  # [T, C]
                    hd = attn.head_dim
                    q = attn.q_proj(x[qpos:qpos + 1]).view(1, heads, hd).transpose(0, 1)  # [H, 1, D]
                    k = attn.k_proj(x[:qpos + 1]).view(qpos + 1, heads, hd).transpose(0, 1)  # [H, T, D]
                    scores = (q @ k.transpose(1, 2))[:, 0] / math.sqrt(hd)  # [H, T]
                    scores = scores + alibi.bias(slopes[:, None], torch.tensor(qpos), torch.arange(qpos + 1),
                                                 bias.scaling)
                    w = torch.softmax(scores, dim=-1)
                    mass[n][li] += w[:, span].sum(-1) / args.samples
            far_bias[n] = (sum(distances) / len(distances), slopes)
        for h in handles:
            h.remove()
        print(f"\nmethod {method.label}: attention mass on the queried record, from the position "
              f"predicting the answer ({args.samples} prompts per length)")
        n_max = max(lengths)
        mean_distance, slopes_max = far_bias[n_max]
        far = alibi.bias(slopes_max, torch.tensor(float(mean_distance)), torch.tensor(0.0), bias.scaling)
        print("| layer | head | slope | " + " | ".join(f"mass at {n}" for n in lengths)
              + f" | slope at {n_max} | bias at mean distance {mean_distance:.0f} |")
        print("|---|---|---|" + "---|" * len(lengths) + "---|---|")
        cells = [(li, h) for li in range(len(layers)) for h in range(heads)]
        if args.top:  # the heads that retrieve at the first length, most mass first
            cells = sorted(cells, key=lambda lh: -float(mass[lengths[0]][lh]))[:args.top]
        for li, h in cells:
            print(f"| {li + 1} | {h + 1} | {base[h]:.4g} | "
                  + " | ".join(f"{mass[n][li, h]:.2f}" for n in lengths)
                  + f" | {slopes_max[h]:.4g} | {far[h]:.2f} |")
        for n in lengths:
            per = digit_hits[n]
            print(f"length {n}: greedy answer token correct (teacher-forced) "
                  + ", ".join(f"#{i + 1} {100 * float(v):.0f}%" for i, v in enumerate(per[:-1]))
                  + f"; all {100 * float(per[-1]):.0f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
