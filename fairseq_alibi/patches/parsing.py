"""fairseq's command-line parsers: a mistake is one error line, not the usage."""

from __future__ import annotations

import functools


def one_line_argument_errors() -> None:
    """fairseq's parsers (``options.get_parser``, which every ``get_*_parser``
    builds on, and any parser ``options.parse_args_and_arch`` is given) become
    ``arguments.OneLineParser``: an option fairseq cannot parse or does not take
    is one ``error:`` line naming what it takes and where it belongs, exit
    status 1.  Reaches a stock ``fairseq-* --user-dir`` from its second parse
    (the first ends by importing the plugin), where its options are checked.

    Kind: crash.  Stock: argparse printed the whole usage (100-170 lines) and
    exited with status 2, naming neither what the option takes nor, for
    ``--fox-init-slopes`` on ``--arch transformer_lm_alibi`` or ``--position-scaling``
    given to fairseq-eval-lm, where it belongs."""
    from fairseq import options

    from ..arguments import one_line_errors

    if getattr(options.parse_args_and_arch, "_alibi_one_line", False):
        return
    stock_parser, stock_parse = options.get_parser, options.parse_args_and_arch

    @functools.wraps(stock_parser)
    def get_parser(*args, **kwargs):
        return one_line_errors(stock_parser(*args, **kwargs))

    @functools.wraps(stock_parse)
    def parse_args_and_arch(parser, *args, **kwargs):
        return stock_parse(one_line_errors(parser), *args, **kwargs)

    parse_args_and_arch._alibi_one_line = True
    options.get_parser, options.parse_args_and_arch = get_parser, parse_args_and_arch
