#!/usr/bin/env python
"""Length generalization on a synthetic seq2seq task: ALiBi vs sinusoidal.

Trains ``transformer_alibi`` (bidirectional ALiBi encoder, causal ALiBi
decoder) and the stock ``transformer`` (sinusoidal positions) with identical
sizes and schedules on short copy (or reverse) sequences, then decodes
greedily on longer ones and reports exact-match accuracy by source length.

    python scripts/seq2seq_lengthgen.py --workdir /tmp/lengthgen

Steps: write the raw data, ``fairseq-preprocess`` it (joined dictionary),
``fairseq-train`` each model (stock CLIs, the plugin loaded with --user-dir),
then greedy decoding in-process on each length bin.  Small by design: a few
minutes on two CPU cores.
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

BIN = os.path.dirname(sys.executable)


def make_pair(rng, length, vocab, kind, distinct=False):
    if distinct:  # no repeated token: the copy pointer is never ambiguous
        src = [f"t{i}" for i in rng.sample(range(vocab), length)]
    else:
        src = [f"t{rng.randrange(vocab)}" for _ in range(length)]
    tgt = src[::-1] if kind == "reverse" else list(src)
    return " ".join(src), " ".join(tgt)


def write_split(path, pairs):
    with open(path + ".src", "w") as s, open(path + ".tgt", "w") as t:
        for src, tgt in pairs:
            s.write(src + "\n")
            t.write(tgt + "\n")


def parse_bins(text):
    bins = []
    for part in text.split(","):
        low, high = part.split("-")
        bins.append((int(low), int(high)))
    return bins


def run(cmd, log_path, threads=1):
    start = time.time()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with open(log_path, "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
    return time.time() - start


def train(args, data_bin, arch, save_dir, extra):
    cmd = [
        os.path.join(BIN, "fairseq-train"), data_bin,
        "--user-dir", args.user_dir, "--task", "translation", "-s", "src", "-t", "tgt",
        "--arch", arch, "--cpu", "--seed", str(args.seed),
        "--encoder-layers", str(args.layers), "--decoder-layers", str(args.layers),
        "--encoder-embed-dim", str(args.dim), "--decoder-embed-dim", str(args.dim),
        "--encoder-ffn-embed-dim", str(2 * args.dim), "--decoder-ffn-embed-dim", str(2 * args.dim),
        "--encoder-attention-heads", str(args.heads), "--decoder-attention-heads", str(args.heads),
        "--share-all-embeddings", "--dropout", "0.0",
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", str(args.lr),
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(args.warmup),
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.0",
        "--max-tokens", str(args.max_tokens), "--max-update", str(args.updates),
        "--save-dir", save_dir, "--no-epoch-checkpoints", "--no-save-optimizer-state",
        "--disable-validation", "--log-format", "simple", "--log-interval", "100",
        "--num-workers", "0", *extra,
    ]
    return run(cmd, save_dir + ".log", args.threads)


def evaluate(checkpoint, data_bin, eval_sets, beam=1):
    """Exact-match accuracy per length bin, greedy (beam 1) decoding."""
    import torch
    from fairseq import checkpoint_utils
    from fairseq.sequence_generator import SequenceGenerator

    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [checkpoint], arg_overrides={"data": data_bin}
    )
    model = models[0].eval()
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    generator = SequenceGenerator([model], tgt_dict, beam_size=beam, max_len_a=1.0, max_len_b=5)
    results = {}
    for name, pairs in eval_sets.items():
        correct = 0
        for start in range(0, len(pairs), 50):
            chunk = pairs[start : start + 50]
            tokens = [src_dict.encode_line(s, add_if_not_exist=False).long() for s, _ in chunk]
            lengths = torch.tensor([t.numel() for t in tokens])
            batch = torch.full((len(tokens), int(lengths.max())), src_dict.pad(), dtype=torch.long)
            for row, t in enumerate(tokens):  # left padding, as the translation task
                batch[row, batch.size(1) - t.numel() :] = t
            sample = {"net_input": {"src_tokens": batch, "src_lengths": lengths}}
            with torch.no_grad():
                hypos = generator.generate([model], sample)
            for (_, tgt), hyp in zip(chunk, hypos):
                correct += tgt_dict.string(hyp[0]["tokens"]) == tgt
        results[name] = correct / len(pairs)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/alibi_lengthgen")
    parser.add_argument("--kind", choices=["copy", "reverse"], default="copy")
    parser.add_argument("--vocab", type=int, default=40)
    parser.add_argument("--distinct", action="store_true",
                        help="sample each sequence without repeated tokens (needs --vocab >= longest)")
    parser.add_argument("--train-lengths", default="4-12")
    parser.add_argument("--eval-bins", default="4-12,13-16,17-24,25-32,33-48")
    parser.add_argument("--train-size", type=int, default=8000)
    parser.add_argument("--eval-size", type=int, default=200, help="sentences per bin")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--updates", type=int, default=800)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--alibi-bidirectional", default="symmetric")
    parser.add_argument("--models", default="alibi,sinusoidal")
    parser.add_argument("--user-dir", default=None, help="default: alibi-user-dir")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is fastest for these tiny models on a busy machine)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.user_dir is None:
        import fairseq_alibi.models  # noqa: F401  (registers the models, applies patches.py)

        args.user_dir = os.path.dirname(os.path.abspath(fairseq_alibi.__file__))

    rng = random.Random(args.seed)
    low, high = parse_bins(args.train_lengths)[0]
    raw = os.path.join(args.workdir, "raw")
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(raw)
    write_split(os.path.join(raw, "train"),
                [make_pair(rng, rng.randint(low, high), args.vocab, args.kind, args.distinct) for _ in range(args.train_size)])
    write_split(os.path.join(raw, "valid"),
                [make_pair(rng, rng.randint(low, high), args.vocab, args.kind, args.distinct) for _ in range(100)])
    eval_sets = {
        f"{a}-{b}": [make_pair(rng, rng.randint(a, b), args.vocab, args.kind, args.distinct) for _ in range(args.eval_size)]
        for a, b in parse_bins(args.eval_bins)
    }
    data_bin = os.path.join(args.workdir, "data-bin")
    run([os.path.join(BIN, "fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
         "--trainpref", os.path.join(raw, "train"), "--validpref", os.path.join(raw, "valid"),
         "--joined-dictionary", "--destdir", data_bin, "--workers", "1"],
        os.path.join(args.workdir, "preprocess.log"))

    configs = {
        "alibi": ("transformer_alibi", ["--alibi-bidirectional", args.alibi_bidirectional]),
        "sinusoidal": ("transformer", []),
    }
    report = {"args": vars(args), "results": {}}
    for name in args.models.split(","):
        arch, extra = configs[name]
        save_dir = os.path.join(args.workdir, name)
        seconds = train(args, data_bin, arch, save_dir, extra)
        start = time.time()
        accuracy = evaluate(os.path.join(save_dir, "checkpoint_last.pt"), data_bin, eval_sets)
        report["results"][name] = {
            "arch": arch, "train_seconds": round(seconds, 1),
            "eval_seconds": round(time.time() - start, 1), "exact_match": accuracy,
        }
        print(name, json.dumps(report["results"][name]), flush=True)

    bins = list(eval_sets)
    print(f"\n{args.kind}, trained on lengths {args.train_lengths}; greedy exact match by source length")
    print("| model | " + " | ".join(bins) + " |")
    print("|---|" + "---|" * len(bins))
    for name, res in report["results"].items():
        print(f"| {name} ({res['arch']}) | " + " | ".join(f"{100 * res['exact_match'][b]:.1f}" for b in bins) + " |")
    with open(os.path.join(args.workdir, "results.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
