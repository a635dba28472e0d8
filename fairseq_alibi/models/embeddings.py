"""The token embedding of a language model, chosen by the stock LM's config
fields: character CNN (``--character-embeddings``), adaptive input
(``--adaptive-input``) or a plain table, built as fairseq 0.12's
``TransformerLanguageModel.build_model`` builds it, so that a seed gives the
same weights; config strings are read as literals, never run."""

import ast
from typing import Callable, List, Optional

from fairseq.modules import AdaptiveInput, CharacterTokenEmbedder

from ..errors import ConfigError


def input_embedding(args, dictionary, plain: Callable):
    """The embedding ``args`` asks for; ``plain(args, dictionary, dim)`` builds a
    plain table (the model class's ``build_embedding``)."""
    if args.character_embeddings:
        return CharacterTokenEmbedder(
            dictionary, _literal(args, "character_filters", "a list of (width, channels) pairs"),
            args.character_embedding_dim, args.decoder_embed_dim, args.char_embedder_highway_layers,
        )
    if args.adaptive_input:
        return AdaptiveInput(
            len(dictionary), dictionary.pad(), args.decoder_input_dim, args.adaptive_input_factor,
            args.decoder_embed_dim, _int_list(args, "adaptive_input_cutoff"),
            args.quant_noise_pq, args.quant_noise_pq_block_size,
        )
    return plain(args, dictionary, args.decoder_input_dim)


def _literal(args, name: str, what: str):
    """A config string holding a Python literal, read without running it (stock
    fairseq ``eval``s it, also from a checkpoint's config)."""
    text = getattr(args, name)
    if not isinstance(text, str):
        return text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(f"{name}={text!r} is not valid: give {what}") from None


def _int_list(args, name: str) -> Optional[List[int]]:
    """A comma-separated list of integers (``"20000,60000"``), as fairseq's
    ``eval_str_list`` reads it: a single number is a list of one."""
    if getattr(args, name) is None:
        return None
    what = "comma-separated integers, e.g. 20000,60000"
    value = _literal(args, name, what)
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{name}={getattr(args, name)!r} is not valid: give {what}")
    return values


def check_tied_adaptive(args) -> None:
    """``--tie-adaptive-weights`` shares the adaptive input's and softmax's
    tables: both must exist and have the same shape."""
    if not args.tie_adaptive_weights:
        return
    problems = []
    if not args.adaptive_input:
        problems.append("no --adaptive-input")
    if args.adaptive_input_factor != args.adaptive_softmax_factor:
        problems.append(f"--adaptive-input-factor {args.adaptive_input_factor:g} != "
                        f"--adaptive-softmax-factor {args.adaptive_softmax_factor:g}")
    if args.adaptive_softmax_cutoff != args.adaptive_input_cutoff:
        problems.append(f"--adaptive-softmax-cutoff {args.adaptive_softmax_cutoff} != "
                        f"--adaptive-input-cutoff {args.adaptive_input_cutoff}")
    if args.decoder_input_dim != args.decoder_output_dim:
        problems.append(f"--decoder-input-dim {args.decoder_input_dim} != --decoder-output-dim {args.decoder_output_dim}")
    if problems:
        raise ConfigError(f"--tie-adaptive-weights shares the adaptive input's and softmax's weights, but this "
                          f"model has {'; '.join(problems)}: make them match, or leave out --tie-adaptive-weights")
