"""How much attention goes to keys beyond the training length, under each method.

For windows of ``--length`` tokens of a data split, every layer's attention
(heads averaged, the model's own weights through the reference kernel) is
recomputed under each method, and the share of each query's attention that
lands on keys at distance >= L (the training length) is averaged over the
queries in position bands.  Plain ALiBi's far weights decay geometrically,
so their share levels off; a distance cap gives every far key the same bias,
so the share grows with the number of far keys.

    python examples/language_model/far_attention.py data-bin/embedded \\
        outputs/demo/alibi/checkpoint_last.pt --length 1024 --methods none,cap,cap:2
"""

from __future__ import annotations

import argparse
import logging
import sys


def far_shares(model, tokens, train_length: int, bands):
    """Per layer: the mean attention share on keys >= ``train_length`` away, per query band."""
    import torch

    weights = {}

    def recompute_with_weights(module, args, kwargs, output):
        # the decoder layer asks its self-attention for no weights; ask again, same input
        query = kwargs.get("query", args[0] if args else None)
        weights[module] = module.forward(query, query, query, need_weights=True)[1]  # [B, T, S], heads averaged

    attentions = [layer.self_attn for layer in model.decoder.layers]
    hooks = [a.register_forward_hook(recompute_with_weights, with_kwargs=True) for a in attentions]
    try:
        with torch.no_grad():
            model.decoder.extract_features(tokens, None)
    finally:
        for hook in hooks:
            hook.remove()
    shares = []
    for attention in attentions:
        attn = weights[attention]
        length = attn.size(-1)
        far = (torch.arange(length)[:, None] - torch.arange(length)[None, :]) >= train_length
        share = (attn * far).sum(-1)
        shares.append([float(share[:, lo:hi].mean()) for lo, hi in bands])
    return shares


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="the model's fairseq-preprocess directory")
    p.add_argument("checkpoint")
    p.add_argument("--subset", default="valid")
    p.add_argument("--length", type=int, default=1024, help="window length in tokens (default: %(default)s)")
    p.add_argument("--windows", type=int, default=8, help="windows averaged (default: %(default)s)")
    p.add_argument("--methods", default="none,cap,cap:2")
    args = p.parse_args(argv)

    import torch
    from fairseq import checkpoint_utils
    from fairseq.data import data_utils

    import fairseq_alibi.models  # noqa: F401  (registers the models, applies patches.py)
    from fairseq_alibi.models.attention import biases, rescale
    from fairseq_alibi.errors import EvaluationError
    from fairseq_alibi.evaluation.axes import parse_methods
    from fairseq_alibi.evaluation.data_dir import check_data

    logging.disable(logging.WARNING)  # importing fairseq set the root logger to DEBUG
    try:  # the inputs, before anything is read: one error line, no traceback
        check_data(args.data, args.subset)
        models, _ = checkpoint_utils.load_model_ensemble([args.checkpoint], arg_overrides={"data": args.data})
    except (EvaluationError, OSError, KeyError, RuntimeError) as e:
        raise SystemExit(f"error: cannot read {args.checkpoint} with {args.data}: {e}")
    model = models[0].eval()
    train_length = biases(model)[0].scaling.train_length
    dataset = data_utils.load_indexed_dataset(f"{args.data}/{args.subset}", None)
    stream = torch.cat([dataset[i] for i in range(len(dataset))])
    if stream.numel() < args.length * args.windows:
        raise SystemExit(f"error: {args.subset} has {stream.numel()} tokens, fewer than {args.windows} windows "
                         f"of {args.length}; lower --windows or --length")
    tokens = stream[: args.length * args.windows].view(args.windows, args.length)
    for layer in model.decoder.layers:
        layer.self_attn.kernel = "reference"  # the only kernel that returns attention weights
    edges = sorted({train_length, 2 * train_length, args.length // 4, args.length // 2, args.length - train_length,
                    args.length} - {0})
    bands = [(lo, hi) for lo, hi in zip(edges, edges[1:]) if lo < hi]
    print(f"attention share on keys >= {train_length} tokens away (L = {train_length}), heads averaged, "
          f"{args.windows} windows of {args.length} tokens of {args.subset}")
    print("| method | layer | " + " | ".join(f"queries {lo}-{hi - 1}" for lo, hi in bands) + " |")
    print("|---|---|" + "---|" * len(bands))
    for method in parse_methods(args.methods):
        rescale(model, method.with_train_length(train_length))
        for layer, row in enumerate(far_shares(model, tokens, train_length, bands), 1):
            print(f"| {method.label} | {layer} | " + " | ".join(f"{v:.3f}" for v in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
