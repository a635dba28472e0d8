"""``alibi-export-hf CHECKPOINT OUTPUT_DIR``: a fairseq LM of this plugin as a Hugging Face model.

* ``--format custom``: ``AlibiForCausalLM`` (``modeling_alibi.py``), exact for
  every ``transformer_lm_alibi`` variant and every other position method
  (rotary, T5 bias, Kerple, FIRE, NoPE, fairseq's stock sinusoidal
  ``transformer_lm``); its code travels with the model, so
  ``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)`` loads
  it without this package; context extension in ``config.json``
  (``alibi_scaling``, or ``rope_parameters`` for rotary; ``--position-scaling``);
* ``--format bloom``: stock ``BloomForCausalLM`` for BLOOM-shaped models
  (``export/bloom.py``), no custom code;
* ``--format gpt-neox``: stock ``GPTNeoXForCausalLM`` for pre-norm rotary
  models (``export/neox.py``), no custom code;
* ``--format auto`` (default): ``gpt-neox`` for a rotary model GPT-NeoX holds,
  else ``custom`` (for a rotary model, with one line saying why).

Weights in safetensors, the tokenizer beside them (``export/tokenizer.py``).
The directory is written under a temporary name (``export/writer.py``); its
files are loaded back as a user loads them and scored against the checkpoint
(``export/check.py``: the precision lost to ``--dtype`` reported, a conversion
error refused); only then is it renamed into place.
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Optional, Tuple

import torch

from ..core.positions import BLOOM, CUSTOM, NEOX, attention_entry, extensions, holding
from ..core.scaling import Scaling
from ..errors import ExportError, report_errors
from ..hf import quiet_transformers
from .check import check_written
from .source import Source, load_source
from .writer import check_output_dir, staged_directory, write_code

FORMATS = ("auto", CUSTOM, BLOOM, NEOX)
#: How a stock format is named in a line.
LABELS = {BLOOM: "BLOOM", NEOX: "GPT-NeoX"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
def resolve_scaling(text: Optional[str], source: Source) -> Scaling:
    """``--position-scaling METHOD[:F]``, else what the checkpoint's config asks for."""
    if text is None:
        return source.scaling
    scaling = Scaling.parse(text, source.train_length)
    if scaling.needs_train_length and source.train_length is None:
        raise ExportError(f"--position-scaling {text} needs the training length, which {source.path} does not "
                          "record (no alibi_train_length or tokens_per_sample)")
    allowed = extensions(source.position)
    if scaling.method not in allowed:
        raise ExportError(f"--position-scaling {text} does not apply to {source.position} models; the methods that "
                          f"do: {', '.join(allowed)}")
    return scaling.complete()


def choose_format(fmt: str, source: Source, scaling: Scaling) -> Tuple[str, Optional[str]]:
    """(the format to write, a note saying why ``auto`` chose the default format
    over the stock one the method prefers, or None): ``auto`` writes the first of
    the position method's ``exports`` (its registry entry) that holds the model."""
    if fmt != "auto":
        return fmt, None
    preferred = attention_entry(source.position).exports[0]
    if preferred == CUSTOM:
        return CUSTOM, None
    found = stock_problems(preferred, source, scaling)
    if not found:
        return preferred, None
    return CUSTOM, (f"format custom (trust_remote_code=True): {LABELS[preferred]} cannot hold this "
                    f"{source.position} model: {'; '.join(found)}")


def stock_problems(fmt: str, source: Source, scaling: Scaling) -> List[str]:
    """What the stock format ``fmt`` cannot hold of ``source``'s model."""
    from .custom import describe

    if fmt == BLOOM:
        from .bloom import bloom_problems

        return bloom_problems(describe(source), scaling)
    from .neox import neox_shape_problems, rotary_settings

    fields = describe(source)
    _, rotary_dim = rotary_settings(source.cfg.model, fields["hidden_size"] // fields["attention_heads"],
                                    source.position)
    return neox_shape_problems(fields, source.position, rotary_dim, scaling)


def build_model(source: Source, fmt: str, scaling: Scaling):
    """The transformers model of ``source`` in format ``fmt``."""
    from .custom import build_custom, describe, hf_weights

    holds = fmt in attention_entry(source.position).exports
    if fmt == BLOOM:
        from .bloom import build_bloom

        if not holds:
            raise ExportError(f"the BLOOM format holds {', '.join(holding(BLOOM))} models; this is a "
                              f"{source.position} model: export it in the default format (--format custom)")
        return build_bloom(describe(source), hf_weights(source.model), scaling)
    if fmt == NEOX:
        from .neox import build_neox, check_neox

        if not holds:
            check_neox({}, source.position, None, scaling)
        return build_neox(describe(source), hf_weights(source.model), source.cfg.model, scaling, source.position)
    return build_custom(source, scaling)


def export(checkpoint: str, output_dir: str, fmt: str = "auto", position_scaling: Optional[str] = None,
           force: bool = False, dict_path: Optional[str] = None, bpe_files: Optional[Dict[str, str]] = None,
           dtype: str = "float32") -> dict:
    """Export ``checkpoint`` to ``output_dir``; a summary of what was written."""
    from .tokenizer import build_tokenizer, save_tokenizer

    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r} is not valid; allowed: {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not valid; allowed: {', '.join(DTYPES)}")
    inputs = [checkpoint, dict_path, *(bpe_files or {}).values()]
    check_output_dir(output_dir, force, inputs)
    source = load_source(checkpoint, dict_path)
    scaling = resolve_scaling(position_scaling, source)
    tokenizer = build_tokenizer(source, bpe_files or {})
    source.unk_aliases = max(0, len(tokenizer) - len(source.dictionary))
    fmt, note = choose_format(fmt, source, scaling)
    model = build_model(source, fmt, scaling)
    model.generation_config.suppress_tokens = [source.dictionary.pad()]  # fairseq's generator never emits <pad>
    with staged_directory(output_dir, force, inputs) as stage:
        with quiet_transformers():
            model.to(DTYPES[dtype]).save_pretrained(stage)
            if fmt == CUSTOM:
                write_code(stage, source.position)
            save_tokenizer(tokenizer, stage)
        del model  # what is checked, and described, is what the files hold
        written = check_written(stage, fmt, source, scaling)
    return {"output_dir": output_dir, "format": fmt, "written": written, "checkpoint_dtype": source.weights_dtype,
            "note": note}


def parser() -> argparse.ArgumentParser:
    from ..arguments import OneLineParser

    p = OneLineParser(
        prog="alibi-export-hf",
        description="Export a fairseq language model of this plugin (transformer_lm_alibi, also converted "
        "2021-fork checkpoints, and the other position methods' transformer_lm_<method>) to a Hugging Face "
        "transformers model directory (docs/export.md).")
    p.add_argument("checkpoint", help="the fairseq checkpoint (.pt), read with allowlisted unpickling")
    p.add_argument("output_dir", help="the directory to write (must not exist or be empty, unless --force)")
    p.add_argument("--format", default="auto", choices=FORMATS,
                   help="auto (default): gpt-neox for a rotary model it holds, else custom; custom: exact for "
                   "every model, loads with trust_remote_code=True; bloom: stock BloomForCausalLM for "
                   "BLOOM-shaped ALiBi models; gpt-neox: stock GPTNeoXForCausalLM for pre-norm rotary models")
    p.add_argument("--position-scaling", "--alibi-scaling", dest="position_scaling", metavar="METHOD[:F]",
                   help="context extension stored in config.json, for the model's position method (the "
                   "position_scaling of its config): none, linear[:F], ntk[:F] (no F: dynamic), cap[:F], ...; "
                   "rotary: none, linear, ntk, yarn (default: the checkpoint's own; --alibi-scaling: the older "
                   "name)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUTPUT_DIR")
    p.add_argument("--dict", dest="dict_path", metavar="DICT",
                   help="the model's dict.txt (default: the one in its training data directory)")
    p.add_argument("--gpt2-encoder-json", metavar="PATH", help="--bpe gpt2 checkpoints: GPT-2's encoder.json")
    p.add_argument("--gpt2-vocab-bpe", metavar="PATH", help="--bpe gpt2 checkpoints: GPT-2's vocab.bpe")
    p.add_argument("--dtype", default="float32", choices=tuple(DTYPES), help="dtype of the saved weights")
    return p


def summary(done: dict) -> str:
    """The lines ``alibi-export-hf`` prints: what the written files hold and the check's numbers."""
    written = done["written"]
    load = "trust_remote_code=True" if done["format"] == "custom" else "no custom code"
    note = f"{done['note']}\n" if done.get("note") else ""
    return note + (f"wrote {done['output_dir']}: {written.cls} ({load}), {written.check.dtype}, vocabulary "
            f"{written.vocabulary}, alibi_train_length {written.train_length}, scaling {written.scaling.label}\n"
            f"{written.check.describe(done['checkpoint_dtype'])}\n")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    with report_errors(interrupted="alibi-export-hf interrupted (nothing written)"):
        done = export(args.checkpoint, args.output_dir, args.format, args.position_scaling, args.force,
                      args.dict_path, {"gpt2_encoder_json": args.gpt2_encoder_json,
                                       "gpt2_vocab_bpe": args.gpt2_vocab_bpe}, args.dtype)
        sys.stdout.write(summary(done))
    return 0
