"""fairseq's ``eval_lm`` guarded: no perplexity printed from nothing scored,
from part of the split, or from a loss that is not a number."""

from __future__ import annotations

import sys


def guarded_eval_lm(module) -> None:
    """Applied to ``fairseq_cli.eval_lm`` (passed as ``module``) by
    ``alibi-eval-lm``, and by :func:`guarded_stock_eval_lm` when a stock
    ``fairseq-eval-lm --user-dir`` loaded the plugin.  Idempotent.

    Kind: wrong result.  Stock: fairseq's ``eval_lm`` prints loss 0 /
    perplexity 1.00 when it scored no token, prints NaN as a result,
    prints a perplexity over part of the split when its loader skipped blocks
    longer than the model's positions, and scores one shorter block under the
    name of a ``--tokens-per-sample`` longer than the split; here each stops
    with one error line (the checks are ``coverage.py``'s)."""
    import math

    from ..errors import UserError
    from .. import coverage

    stock = module.eval_lm
    if getattr(stock, "_alibi_guarded", False):
        return
    stock_main = module.main

    def main(cfg, *args, **kwargs):
        subset = cfg.dataset.gen_subset
        with coverage.recorded_loaders(subset, lambda dataset: coverage.check_block_length(dataset, cfg.task, subset)):
            return stock_main(cfg, *args, **kwargs)

    def eval_lm(*args, **kwargs):
        scored = [0]
        batches = kwargs.pop("batch_iterator") if "batch_iterator" in kwargs else args[2]
        tally = coverage.Tally(bool(kwargs.get("remove_bos_token", False)))

        def counted():
            for sample in batches:
                if isinstance(sample, dict) and "net_input" in sample:
                    scored[0] += int(sample.get("ntokens", 0))
                yield sample

        if "batch_iterator" in kwargs or len(args) < 3:
            kwargs["batch_iterator"] = counted()
        else:
            args = args[:2] + (counted(),) + args[3:]
        with coverage.tallied_scorer(module, tally):
            results = stock(*args, **kwargs)
        models = kwargs.get("models", args[0] if args else None)
        coverage.check_eval_lm(models, tally)  # first: a split with tokens, scored in part or not at all
        if scored[0] == 0:
            raise UserError("no token was evaluated (fairseq would print perplexity 1.00): the split is empty; "
                            "give a --gen-subset that holds text")
        if not math.isfinite(results["loss"]):
            raise UserError(
                f"the loss is {results['loss']}, not a number: the checkpoint's weights or the evaluation "
                "produce non-finite values (a diverged or damaged checkpoint?); no result is printed"
            )
        return results

    eval_lm._alibi_guarded = True
    module.eval_lm, module.main = eval_lm, main


def guarded_stock_eval_lm() -> None:
    """A stock ``fairseq-eval-lm --user-dir`` imports the plugin while parsing
    its options, its ``fairseq_cli.eval_lm`` module already loaded: it gets
    :func:`guarded_eval_lm` too.

    Kind: wrong result.  Stock: a perplexity over part of the split, or over
    nothing, printed with exit status 0."""
    module = sys.modules.get("fairseq_cli.eval_lm")
    if module is not None and hasattr(module, "eval_lm"):
        guarded_eval_lm(module)
