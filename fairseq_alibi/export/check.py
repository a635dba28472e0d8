"""The export's check: the files written, loaded back as a user loads them,
against the checkpoint as given.

Run on the staged directory before it is renamed into place (``writer.py``):
the model is read back from its files with transformers
(``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` for the
default format, transformers' own classes for ``--format bloom`` and
``gpt-neox``), in the dtype the files hold, and scored on random tokens beside the fairseq model of the
checkpoint, computed in float32.  Two numbers, max |log-prob difference|:

* ``rounding``: the files as loaded (computed in their dtype) against the
  checkpoint: what the user holds; 0 up to float32 rounding for a float32
  export, the precision lost for bfloat16 or float16.  Reported, never hidden;
* ``same_precision``: the files' weights computed in float32 against the
  fairseq model given the same rounded weights, computed in float32 (for
  GPT-NeoX, the written weights mapped back, its folded embedding scale
  divided out): what is left is a conversion error, refused above ``TOLERANCE`` (nothing written).
  Both computed in float32 because two correct programs in bfloat16 differ by
  bfloat16's own rounding (BLOOM's bias form, the adaptive softmax).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass, replace
from typing import Iterator, Optional

import torch

from ..core.positions import SINUSOIDAL
from ..core.scaling import Scaling
from ..errors import ExportError

#: A conversion error: same-precision difference above this, in log-probabilities.
TOLERANCE = 1e-4
#: Random tokens the check scores (past where an extension acts, when it acts late: :func:`check_length`).
TOKENS = 24
#: The longest input the check scores to reach an extension: two full forwards of the model, and a
#: ``[length, vocabulary]`` table of log-probabilities for each.
MAX_CHECK_LENGTH = 2048


def extension_start(scaling: Scaling) -> Optional[int]:
    """The input length past which ``scaling`` changes anything (a dynamic factor
    past the training length; a distance method past its ``C``; a logit method
    past its base length), or None for none or a static factor, which acts at
    every position."""
    if scaling.method == "none":
        return None
    if scaling.dynamic:
        return scaling.complete().train_length
    if scaling.distance_limit is not None:
        return scaling.distance_limit
    if scaling.logit_base is not None:
        return int(scaling.logit_base)
    return None


def position_reach(model) -> Optional[int]:
    """The distance past which a model's own position settings act otherwise,
    or None where they act alike at every distance: RNoPE's window (farther
    keys hidden from its RoPE layers), T5's max distance (every farther key in
    one bucket), FIRE's learned threshold (queries past it normalize by their
    own position)."""
    from ..core.fire import Fire
    from ..core.hybrid import HybridPositions
    from ..core.t5bias import T5Bias
    from ..models.attention import biases

    reach = [int(stack.window) for stack in biases(model) if isinstance(stack, HybridPositions)]
    for module in model.modules():  # the learned biases' parameters: modules of the model
        if isinstance(module, T5Bias):
            reach.append(int(module.max_distance))
        elif isinstance(module, Fire):
            reach.append(math.ceil(float(module.threshold)))
    return max(reach) if reach else None


def check_length(scaling: Scaling, reach: Optional[int] = None) -> int:
    """Tokens the check scores: :data:`TOKENS`, or that many past where the
    extension starts to act or the model's own settings change (``reach``,
    :func:`position_reach`), at most :data:`MAX_CHECK_LENGTH`: on 24 tokens a
    model trained on 512 computes the same with a dynamic or distance extension
    as without, and an RNoPE window of 256 hides no key, so a wrongly written
    one would pass."""
    starts = [s for s in (extension_start(scaling), reach) if s is not None]
    return TOKENS if not starts else max(TOKENS, min(MAX_CHECK_LENGTH, max(starts) + TOKENS))


@dataclass(frozen=True)
class Check:
    """What the check measured on the written files."""

    dtype: str  # what the written weights hold, as loaded back ("bfloat16")
    rounding: float  # files as loaded vs the checkpoint in float32
    same_precision: float  # the files' weights vs fairseq's rounded alike, both in float32
    tokens: int = TOKENS  # the random tokens scored
    unreached: Optional[int] = None  # where an extension starts to act, if past the tokens scored

    def describe(self, checkpoint_dtype: str) -> str:
        """One line: what was compared and the numbers, each with its meaning."""
        head = (f"check: the written files loaded back, against the checkpoint ({checkpoint_dtype} weights, "
                f"computed in float32), on {self.tokens} random tokens: max |log-prob difference| ")
        if self.dtype == "float32":
            line = head + f"{self.rounding:.2g}"
        else:
            line = head + (f"{self.rounding:.2g} ({self.dtype} rounding); same-precision difference "
                           f"{self.same_precision:.2g} (against the fairseq model given the same {self.dtype} "
                           "weights, both computed in float32)")
        if self.unreached is not None:
            line += (f"; the context extension acts past {self.unreached} tokens, beyond the check's "
                     f"{self.tokens}: not exercised by it")
        return line


def check_tokens(dictionary, length: int = TOKENS) -> torch.Tensor:
    """``[1, length]`` random ids of ``dictionary``'s words (seed 0), ``</s>`` first."""
    vocab, first = len(dictionary), dictionary.nspecial
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(first, max(vocab, first + 1), (1, length), generator=generator)
    tokens[0, 0] = dictionary.eos()
    return tokens


def fairseq_log_probs(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.get_normalized_probs(model(tokens), log_probs=True).float()


def hf_log_probs(model, tokens: torch.Tensor) -> torch.Tensor:
    """The model's logits in its own dtype, normalized in float32 (as fairseq normalizes)."""
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits.float().log_softmax(-1)


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@contextlib.contextmanager
def private_module_cache() -> Iterator[str]:
    """A scratch directory, and transformers' cache of remote code in it for the
    block, the modules it imported forgotten after: reading back the staged
    directory leaves nothing in the user's cache or in this process's ``sys.modules``."""
    from transformers import dynamic_module_utils

    package = dynamic_module_utils.TRANSFORMERS_DYNAMIC_MODULE_NAME

    def ours(name: str) -> bool:
        return name == package or name.startswith(package + ".")

    saved_cache, saved_path = dynamic_module_utils.HF_MODULES_CACHE, list(sys.path)
    saved = {name: module for name, module in sys.modules.items() if ours(name)}
    with tempfile.TemporaryDirectory(prefix="alibi_export_check_") as scratch:
        for name in saved:
            del sys.modules[name]
        dynamic_module_utils.HF_MODULES_CACHE = os.path.join(scratch, "modules")
        # first on the path: transformers appends its cache to sys.path once, so a cache put there
        # earlier (any remote code loaded before in this process) would hold the package
        # ``transformers_modules`` that the staged code's imports find, and they would fail
        sys.path.insert(0, dynamic_module_utils.HF_MODULES_CACHE)
        importlib.invalidate_caches()
        try:
            yield scratch
        finally:
            dynamic_module_utils.HF_MODULES_CACHE = saved_cache
            sys.path[:] = saved_path
            for name in [name for name in sys.modules if ours(name)]:
                del sys.modules[name]
            sys.modules.update(saved)


def load_written(directory: str, fmt: str):
    """The model of ``directory`` as a user loads it, in the dtype its files hold
    (transformers' ``dtype="auto"``): stock BLOOM, or for the default format the
    classes ``config.json``'s ``auto_map`` names, from the directory's own code
    files: what ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``
    builds in a fresh process (here, where ``fairseq_alibi.hf`` may have
    registered this package's class for the model type, the Auto class would take that)."""
    from transformers import AutoModelForCausalLM
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from ..hf import quiet_transformers

    options = dict(dtype="auto", local_files_only=True)
    with quiet_transformers():
        if fmt != "custom":
            return AutoModelForCausalLM.from_pretrained(directory, **options).eval()
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as handle:
            reference = json.load(handle)["auto_map"]["AutoModelForCausalLM"]
        cls = get_class_from_dynamic_module(reference, directory, local_files_only=True)
        return cls.from_pretrained(directory, **options).eval()


def written_scaling(config, fmt: str, source, scaling: Scaling) -> Scaling:
    """The context extension the written ``config.json`` holds (BLOOM's holds
    none; GPT-NeoX's ``rope_parameters``, :func:`neox.neox_rope_parameters`)."""
    if fmt == "bloom":
        return Scaling()
    if fmt == "gpt-neox":
        from .neox import neox_rope_parameters, rotary_settings

        head_dim = config.hidden_size // config.num_attention_heads
        base, rotary_dim = rotary_settings(source.cfg.model, head_dim, source.position)
        expected = neox_rope_parameters(scaling, base, rotary_dim, head_dim)
        if dict(config.rope_parameters) != expected:
            raise ExportError(f"the written config.json holds rope_parameters {dict(config.rope_parameters)}, not "
                              f"{expected}: nothing written; a bug, please report it")
        return scaling
    stored = config.scaling()  # the written code's Scaling class: compared through its spellings
    return Scaling.from_record({"method": stored.method, "factor": stored.factor, "alpha": stored.alpha},
                               stored.train_length)


def give_written_weights(source_model, loaded, fmt: str, fields: Optional[dict]) -> None:
    """Give the fairseq model the written weights (rounded to the written dtype),
    in float32, in place: its own weights rounded alike, or for GPT-NeoX the
    written ones mapped back (``neox.fairseq_weights_of_neox``: the input
    embedding with the scale divided out, the output projection its own tensor)."""
    if fmt != "gpt-neox":  # what the files hold: parameters and persistent buffers (not a sinusoidal table)
        with torch.no_grad():
            for tensor in source_model.state_dict(keep_vars=True).values():
                if tensor.is_floating_point():
                    tensor.data = tensor.data.to(loaded.dtype).float()
        return
    from .neox import fairseq_weights_of_neox

    decoder = source_model.decoder
    if decoder.output_projection.weight is decoder.embed_tokens.weight:  # untie: the written pair differs
        decoder.output_projection.weight = torch.nn.Parameter(decoder.embed_tokens.weight.detach().clone())
    mapped = fairseq_weights_of_neox(loaded.state_dict(), fields)
    state = source_model.state_dict()
    with torch.no_grad():
        for name, tensor in mapped.items():
            state[name].copy_(tensor)


def measure(loaded, source_model, tokens: torch.Tensor, fmt: str = "custom", fields: Optional[dict] = None) -> Check:
    """Both numbers for a loaded model and the (rescaled, float32) fairseq model.
    Casts ``loaded`` to float32 and gives ``source_model`` the written weights,
    both in place: neither is used after."""
    dtype, length = loaded.dtype, tokens.size(1)
    reference = fairseq_log_probs(source_model, tokens)
    if not torch.isfinite(reference).all():
        raise ExportError(f"the checkpoint's own log-probabilities are not finite numbers on {length} random tokens "
                          "(computed in float32): nothing written; its weights overflow float32")
    rounding = max_difference(hf_log_probs(loaded, tokens), reference)
    if dtype == torch.float32:
        return Check("float32", rounding, rounding, length)
    give_written_weights(source_model, loaded, fmt, fields)
    same = max_difference(hf_log_probs(loaded.float(), tokens), fairseq_log_probs(source_model, tokens))
    return Check(str(dtype).replace("torch.", ""), rounding, same, length)


def refuse_failed(check: Check) -> None:
    """``ExportError`` for a conversion error (NaN included), or for a written
    model whose log-probabilities are not finite numbers (float16 overflows
    where the checkpoint in float32 did not)."""
    if check.dtype != "float32" and not abs(check.rounding) < float("inf"):
        raise ExportError(f"the written {check.dtype} model's log-probabilities are not finite numbers on "
                          f"{check.tokens} random tokens (its activations overflow {check.dtype}): nothing written; export with "
                          f"--dtype {'bfloat16 or float32' if check.dtype == 'float16' else 'float32'}")
    if not check.same_precision <= TOLERANCE:
        raise ExportError(f"the written model, loaded back, differs from the checkpoint by {check.same_precision:.3g} "
                          f"in log-probabilities beyond {check.dtype} rounding (tolerance {TOLERANCE:g}): nothing "
                          "written; a bug, please report it")


@dataclass(frozen=True)
class Written:
    """What the staged directory holds, read back from its files."""

    cls: str  # the class transformers loads it as
    vocabulary: int
    train_length: Optional[int]
    scaling: Scaling
    check: Check


def check_written(directory: str, fmt: str, source, scaling: Scaling) -> Written:
    """Load ``directory`` back, check it against ``source`` (rescaled to
    ``scaling``); ``ExportError`` if it does not hold them (see :func:`refuse_failed`)."""
    from ..hf import hf_train_length
    from ..models.attention import rescale

    with private_module_cache() as scratch:
        # under a plain name: transformers names the code's module after the directory (the stage's is temporary)
        plain = os.path.join(scratch, "written")
        os.symlink(os.path.abspath(directory), plain)
        loaded = load_written(plain, fmt)
    stored = written_scaling(loaded.config, fmt, source, scaling)
    if stored.to_hf() != scaling.to_hf():
        raise ExportError(f"the written config.json holds the context extension {stored.spelling}, not "
                          f"{scaling.spelling}: nothing written; a bug, please report it")
    if source.position != SINUSOIDAL:  # fairseq's stock LM has no position attention (and no extension)
        rescale(source.model, scaling)
    length = hf_train_length(loaded.config) if fmt != "gpt-neox" else source.train_length
    facts = dict(cls=type(loaded).__name__, vocabulary=int(loaded.config.vocab_size), train_length=length,
                 scaling=stored)
    fields = None
    if fmt == "gpt-neox":
        from .custom import describe

        fields = describe(source)
    length = check_length(scaling, position_reach(source.model))
    check = measure(loaded, source.model, check_tokens(source.dictionary, length), fmt, fields)
    start = extension_start(scaling)
    if start is not None and start >= length:
        check = replace(check, unreached=start)
    refuse_failed(check)
    return Written(check=check, **facts)
