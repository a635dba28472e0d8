"""The registries, asked by the shell recipes (``examples/lib.sh``): which
models exist, which of them have context-extension methods, and which
extension methods of a list apply to the models of a run.

A recipe's defaults are read from ``fairseq_alibi/core/positions.py`` here,
never kept by hand, so a position method added there is trained, swept and
reported by every recipe without an edit to them.  Imports the core only (no
fairseq); one call per recipe (``settings``), as each costs an import of torch.

    python examples/registry.py models      # sinusoidal alibi rotary t5bias nope kerple fire
    python examples/registry.py settings --models-variable POSITIONS --models "alibi kerple" \\
        --methods-variable EXTENSIONS --default-methods none,cap,yarn:2
    # -> POSITIONS='alibi kerple' EXTENDED=alibi EXTENSIONS=none,cap (lines for the shell's eval), or
    #    one error: line and exit status 1: a name that is not a model, a method that does not exist
    #    or (in a list given, not the default) applies to none of the models
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Dict, List, Sequence

from fairseq_alibi.core.errors import ScalingError
from fairseq_alibi.core.positions import POSITIONS
from fairseq_alibi.core.scaling import Scaling

#: The stock transformer_lm's name in the recipes (position embeddings; no registry entry).
SINUSOIDAL = "sinusoidal"


def models() -> List[str]:
    """Every model a recipe trains: the stock sinusoidal LM, then each registered position method."""
    return [SINUSOIDAL, *POSITIONS]


def extensions_of(model: str) -> Sequence[str]:
    """The extension methods that apply to a recipe's model (``none`` alone for the sinusoidal one)."""
    return POSITIONS[model].extensions if model in POSITIONS else ("none",)


def check(names: Sequence[str], variable: str) -> None:
    """Refuse, in one line, a name that is not a model, or no name at all."""
    for name in names:
        if name not in models():
            raise SystemExit(f"error: {variable} names '{name}', which is not a position method; allowed values: "
                             f"{' '.join(models())}")
    if not names:
        raise SystemExit(f"error: {variable} must name at least one model; allowed values: {' '.join(models())}")


def extended(names: Sequence[str], methods: Sequence[str]) -> List[str]:
    """The models among ``names`` that one of ``methods`` (``--methods`` items) other than ``none``
    applies to, each once, in order: the models the recipe's extension sweep evaluates."""
    used = {Scaling.parse(item).method for item in methods} - {"none"}
    return [name for name in dict.fromkeys(names) if used & set(extensions_of(name))]


def applicable(methods: str, names: Sequence[str], variable: str, strict: bool) -> List[str]:
    """The items of the ``--methods`` list ``methods`` that apply to at least one of ``names``.
    ``strict``: an item that applies to none is refused in one line (a list the user gave);
    otherwise it is left out (a recipe's default list, for a run of any subset of methods)."""
    kept = []
    for item in (m.strip() for m in methods.split(",") if m.strip()):
        try:
            method = Scaling.parse(item).method
        except (ScalingError, ValueError) as exc:
            raise SystemExit(f"error: {variable}: {exc}") from None
        if any(method in extensions_of(name) for name in names):
            kept.append(item)
        elif strict:
            which = "; ".join(f"{name}: {', '.join(extensions_of(name))}" for name in dict.fromkeys(names))
            raise SystemExit(f"error: {variable} holds {item}, which applies to none of the models of this run; "
                             f"the methods that do: {which}")
    return kept


def settings(models_variable: str, names: Sequence[str], methods_variable: str, methods: str,
             default_methods: str) -> Dict[str, str]:
    """A recipe's checked settings: the models (every one where ``names`` is empty), those of
    them with extension methods (``EXTENDED``) and the extension methods (``methods`` if given,
    refused if one applies to none of the models; else ``default_methods`` less those)."""
    names = list(names) or models()
    check(names, models_variable)
    if methods.strip():
        kept = applicable(methods, names, methods_variable, strict=True)
    else:
        kept = applicable(default_methods, names, methods_variable, strict=False)
    return {models_variable: " ".join(names), "EXTENDED": " ".join(extended(names, kept)), methods_variable: ",".join(kept)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("models", help="every model a recipe trains: sinusoidal, then each position method")
    sub = commands.add_parser("settings", help="a recipe's models and extension methods, checked, as shell lines")
    sub.add_argument("--models-variable", default="MODELS", help="the models' setting (for its line and messages)")
    sub.add_argument("--models", default="", help="the models, space-separated (default: every one)")
    sub.add_argument("--methods-variable", default="METHODS", help="the methods' setting")
    sub.add_argument("--methods", default="", help="the extension methods given (a --methods list)")
    sub.add_argument("--default-methods", default="none", help="the recipe's default list, kept where it applies")
    args = parser.parse_args(argv)
    if args.command == "models":
        print(*models())
        return 0
    values = settings(args.models_variable, args.models.split(), args.methods_variable, args.methods,
                      args.default_methods)
    for name, value in values.items():
        print(f"{name}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
