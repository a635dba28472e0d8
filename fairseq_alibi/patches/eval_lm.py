"""``alibi-eval-lm``'s guard around fairseq's ``eval_lm``: no perplexity
printed from nothing scored or from a loss that is not a number."""

from __future__ import annotations


def guarded_eval_lm(module) -> None:
    """Scoped to ``alibi-eval-lm`` (its CLI applies it to ``fairseq_cli.eval_lm``,
    passed as ``module``; not applied by :func:`fairseq_alibi.patches.apply`).

    Kind: wrong result.  Stock: fairseq's ``eval_lm`` prints loss 0 /
    perplexity 1.00 when it scored no token, and prints NaN as a result; here
    both stop with one error line."""
    import math

    from ..errors import UserError

    stock = module.eval_lm

    def eval_lm(*args, **kwargs):
        scored = [0]
        batches = kwargs.pop("batch_iterator") if "batch_iterator" in kwargs else args[2]

        def counted():
            for sample in batches:
                if isinstance(sample, dict) and "net_input" in sample:
                    scored[0] += int(sample.get("ntokens", 0))
                yield sample

        if "batch_iterator" in kwargs or len(args) < 3:
            kwargs["batch_iterator"] = counted()
        else:
            args = args[:2] + (counted(),) + args[3:]
        results = stock(*args, **kwargs)
        models = kwargs.get("models", args[0] if args else None)
        if scored[0] == 0:
            limit = models[0].max_positions() if models else None
            raise UserError(
                f"no token was evaluated (fairseq would print perplexity 1.00): the split is empty, or "
                f"every block of --tokens-per-sample is longer than the model accepts ({limit} positions); "
                f"give --tokens-per-sample {limit} or less for a model with position embeddings"
            )
        if not math.isfinite(results["loss"]):
            raise UserError(
                f"the loss is {results['loss']}, not a number: the checkpoint's weights or the evaluation "
                "produce non-finite values (a diverged or damaged checkpoint?); no result is printed"
            )
        return results

    module.eval_lm = eval_lm
