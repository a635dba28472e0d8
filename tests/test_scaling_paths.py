"""Every method, through every spelling and every path, gives the same bias.

The one home of the idea (``Scaling`` and ``alibi.bias``) is checked
from the outside: each row of ``CASES`` spells one method four ways -- a
``--methods`` item, model config fields (``--model-overrides``), the Hugging
Face ``alibi_scaling`` dictionary, ``apply_alibi_scaling`` keywords -- and
each must give the same spec, and then the same bias on every path that
builds one: a fairseq stack's dense bias, the chunked kernel's blocks,
FlexAttention's ``score_mod``, a scaled Hugging Face BLOOM and an exported
model.  The reference is a loop written here from the definitions.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from fairseq_alibi.core import alibi, flex, kernels
from fairseq_alibi.core.scaling import Scaling
from fairseq_alibi.core.bias import AlibiBias

L = 8  # training length
T = 3 * L  # keys of the forward pass: dynamic factor 3, past C for every distance method
HEADS = 4

#: (--methods item, config fields, alibi_scaling dict, apply_alibi_scaling keywords)
CASES = [
    ("none", {"alibi_interpolation": "none"}, None, dict(method="none")),
    ("ntk:2", {"alibi_interpolation": "ntk", "alibi_scale_factor": 2.0}, {"type": "ntk", "factor": 2.0},
     dict(method="ntk", factor=2.0)),
    ("linear", {"alibi_interpolation": "linear", "alibi_scale_factor": 0.0}, {"type": "linear", "train_seq_len": L},
     dict(method="linear", factor=0.0)),
    ("ntk:dynamic", {"alibi_interpolation": "ntk"}, {"type": "ntk", "train_seq_len": L}, dict(method="ntk")),
    ("cap:0.5", {"alibi_interpolation": "cap", "alibi_scale_factor": 0.5}, {"type": "cap", "factor": 0.5},
     dict(method="cap", factor=0.5)),
    ("log:1:0.25", {"alibi_interpolation": "log", "alibi_scale_factor": 1.0, "alibi_tail_alpha": 0.25},
     {"type": "log", "factor": 1.0, "alpha": 0.25}, dict(method="log", factor=1.0, alpha=0.25)),
    ("log", {"alibi_interpolation": "log"}, {"type": "log", "factor": 1.0}, dict(method="log")),
    ("power:0.5:2", {"alibi_interpolation": "power", "alibi_scale_factor": 0.5, "alibi_tail_alpha": 2.0},
     {"type": "power", "factor": 0.5, "alpha": 2.0}, dict(method="power", factor=0.5, alpha=2.0)),
    ("capnorm", {"alibi_interpolation": "capnorm", "alibi_scale_factor": 1.0}, {"type": "capnorm", "factor": 1.0},
     dict(method="capnorm", factor=1.0)),
]
IDS = [case[0] for case in CASES]


@pytest.mark.parametrize("config,message", [
    ({"position_scaling": "ntk:2", "alibi_interpolation": "linear", "alibi_scale_factor": 2.0},
     "position_scaling='ntk:2' is not valid; the older names of the same setting say linear:2 "
     "\\(alibi_interpolation='linear', alibi_scale_factor=2\\); give one of the two"),
    ({"position_scaling": "ntk:0.5"}, "position_scaling='ntk:0.5' is not valid; ntk takes a static factor >= 1"),
    ({"position_scaling": "rope:2"}, "position_scaling='rope:2' is not valid; allowed values: none, linear"),
    ({"position_scaling": 2}, "position_scaling=2 is not valid; give one method spelling"),
    # The older factor and alpha beside the spelling, the older method unset: agreeing or refused
    # (a factor that disagreed was dropped without a word; an alpha gave a false "not a tail").
    ({"position_scaling": "linear:2", "alibi_scale_factor": 4.0},
     "alibi_scale_factor=4.0 is not valid; position_scaling='linear:2' sets the method \\(factor 2\\); "
     "give the factor in position_scaling alone"),
    ({"position_scaling": "log:1", "alibi_tail_alpha": 0.5},
     "alibi_tail_alpha=0.5 is not valid; position_scaling='log:1' sets the method \\(alpha 1\\)"),
    ({"position_scaling": "ntk:2", "alibi_tail_alpha": 0.5},
     "alibi_tail_alpha=0.5 is not valid; position_scaling='ntk:2' sets the method \\(ntk takes no alpha\\)"),
])
def test_position_scaling_and_its_older_names_are_one_setting(config, message):
    """``position_scaling`` is the one spelling; the ``alibi_*`` fields are its aliases: both
    given and agreeing is one spec (the CASES above), disagreeing is refused, never one chosen."""
    with pytest.raises(ValueError, match=message):
        Scaling.from_config(dict(config, alibi_train_length=L))
    assert Scaling.from_config({"position_scaling": "", "alibi_interpolation": "cap",
                                "alibi_train_length": L}) == Scaling("cap", 1.0, L)
    for agreeing in ({"alibi_scale_factor": 0.5}, {"alibi_scale_factor": 0.0}, {"alibi_tail_alpha": None}):
        assert Scaling.from_config({"position_scaling": "cap:0.5", "alibi_interpolation": "none",
                                    "alibi_train_length": L, **agreeing}) == Scaling("cap", 0.5, L)
    assert Scaling.from_config({"position_scaling": "log:1:0.25", "alibi_tail_alpha": 0.25,
                                "alibi_train_length": L}) == Scaling("log", 1.0, L, 0.25)


def naive_causal(scaling: Scaling, slopes, length: int) -> torch.Tensor:
    """[H, T, T] from the definitions, one entry at a time (float64)."""
    factor = scaling.factor_at(length)
    if scaling.method == "linear":
        slopes = [m / factor for m in slopes]
    elif scaling.method == "ntk":
        hi, lo = math.log(max(slopes)), math.log(min(slopes))
        slopes = [m / factor ** ((hi - math.log(m)) / (hi - lo)) for m in slopes]
    limit = scaling.distance_limit
    out = torch.full((len(slopes), length, length), float("-inf"), dtype=torch.float64)
    for h, m in enumerate(slopes):
        for i in range(length):
            for j in range(i + 1):
                d = i - j
                if limit is None or d <= limit:
                    value = -m * d
                elif scaling.method == "log":
                    value = -m * (limit + scaling.alpha * limit * math.log(d / limit))
                elif scaling.method == "power":
                    value = -m * limit - scaling.alpha * math.log(d / limit)
                else:
                    value = -m * limit
                    if scaling.method == "capnorm":
                        value -= math.log(max(i - limit, limit) / limit)
                out[h, i, j] = value
    return out


def spec_of_every_spelling(item, config, hf_dict, keywords):
    specs = {
        "--methods": Scaling.parse(item, L),
        "config": Scaling.from_config(dict(config, alibi_train_length=L)),
        "position_scaling": Scaling.from_config({"position_scaling": item, "alibi_train_length": L}),
        "both names": Scaling.from_config(dict(config, position_scaling=item, alibi_train_length=L)),
        "alibi_scaling": Scaling.from_hf(hf_dict, L),
        "keywords": Scaling(**dict(dict(factor=0.0, alpha=None), **keywords), train_length=L),
    }
    return specs


@pytest.mark.parametrize("item,config,hf_dict,keywords", CASES, ids=IDS)
def test_every_spelling_is_one_spec_that_reads_back(item, config, hf_dict, keywords):
    specs = spec_of_every_spelling(item, config, hf_dict, keywords)
    first = specs["--methods"]
    assert all(spec == first for spec in specs.values()), specs
    assert Scaling.parse(first.spelling, L) == first
    assert Scaling.from_hf(first.to_hf(), L) == first
    assert Scaling.from_config(dict(first.config_values(), alibi_train_length=L)) == first


def visible(bias: torch.Tensor) -> torch.Tensor:
    """The causal entries (j <= i) of ``[..., T, T]``; the rest -inf."""
    upper = torch.ones(bias.shape[-2:], dtype=torch.bool).triu(1)
    return bias.to(torch.float64).masked_fill(upper, float("-inf"))


def score_mod_bias(stack: AlibiBias) -> torch.Tensor:
    """FlexAttention's score_mod evaluated on index grids (zero scores)."""
    mod = flex.score_mod(stack, T, T, torch.device("cpu"))
    h = torch.arange(HEADS)[:, None, None]
    q = torch.arange(T)[None, :, None]
    k = torch.arange(T)[None, None, :]
    return mod(torch.zeros(HEADS, T, T), torch.tensor(0), h, q, k)


def chunked_blocks(stack: AlibiBias) -> torch.Tensor:
    """The bias the chunked kernel uses, read back by running it on q = 0, v = I."""
    q = torch.zeros(1, HEADS, T, T)
    k = torch.zeros(1, HEADS, T, T)
    v = torch.eye(T).expand(1, HEADS, T, T)
    probs, _ = kernels.chunked_kernel(q, k, v, stack, None, 0.0, chunk_size=5)
    return probs[0].log()  # softmax of the bias: equal to it up to each row's constant


def bloom_bias(keywords) -> torch.Tensor:
    """The ``alibi`` argument a scaled BLOOM's first block receives, as [H, T, T]."""
    from transformers import BloomConfig, BloomForCausalLM

    from fairseq_alibi import hf

    torch.manual_seed(0)
    model = BloomForCausalLM(BloomConfig(vocab_size=32, hidden_size=16, n_layer=1, n_head=HEADS)).eval()
    hf.apply_alibi_scaling(model, train_length=L, **keywords)
    seen = {}
    model.transformer.h[0].register_forward_pre_hook(lambda m, a, kw: seen.update(alibi=kw["alibi"]),
                                                     with_kwargs=True)
    with torch.no_grad():
        model(torch.arange(T)[None] % 32)
    return seen["alibi"].reshape(HEADS, T, T)


def exported_bias(hf_dict) -> torch.Tensor:
    from fairseq_alibi.core.configuration_alibi import AlibiLMConfig
    from fairseq_alibi.core.modeling_alibi import AlibiForCausalLM

    config = AlibiLMConfig(vocab_size=32, hidden_size=16, layers=1, attention_heads=HEADS, ffn_dim=32,
                           alibi_train_length=L, alibi_scaling=hf_dict)
    return AlibiForCausalLM(config).model.alibi.dense(T, T, torch.float32, "cpu")


def row_normalized(bias: torch.Tensor) -> torch.Tensor:
    """Each row minus its diagonal entry (softmax sees nothing else)."""
    diagonal = torch.diagonal(bias, dim1=-2, dim2=-1)[..., :, None]
    return bias - diagonal


@pytest.mark.slow
@pytest.mark.parametrize("item,config,hf_dict,keywords", CASES, ids=IDS)
def test_every_path_builds_the_same_bias(item, config, hf_dict, keywords):
    from fairseq_alibi.models.config import build_bias

    scaling = Scaling.parse(item, L)
    expected = naive_causal(scaling, alibi.get_slopes(HEADS).tolist(), T)
    fairseq_stack = build_bias(argparse.Namespace(**dict(config, alibi_train_length=L)), HEADS)
    paths = {
        "fairseq dense": fairseq_stack.dense(T, T, torch.float32, "cpu"),
        "score_mod": visible(score_mod_bias(fairseq_stack)),
        "bloom hooks": visible(bloom_bias(keywords)),
        "exported": exported_bias(hf_dict),
    }
    for name, got in paths.items():
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6, msg=name)
    # the chunked kernel computes softmax(bias): its log equals the bias up to a per-row constant
    torch.testing.assert_close(row_normalized(chunked_blocks(fairseq_stack).double()), row_normalized(expected),
                               rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ one refusal of a bad factor, every tool
#: Factor spellings no tool takes (issue 77): empty (a script's ``yarn:$F`` with F unset), not a finite
#: number, negative, zero where the grammar spells dynamic as a word, too large for a length in tokens,
#: and a factor whose product with the training length L is past int32's tokens.
BAD_FACTORS = {"empty": "", "nan": "nan", "inf": "inf", "negative": "-1", "zero": "0", "1e308": "1e308",
               "times L overflows": str(2**31 // L + 1)}
#: Every method with a factor, and a position method it applies to.
FACTOR_METHODS = {"linear": "alibi", "ntk": "alibi", "yarn": "rotary", "cap": "alibi", "log": "alibi",
                  "power": "alibi", "capnorm": "alibi", "logn": "nope"}


def _number(text: str):
    return None if text == "" else float(text)


def _factor_entry_points():
    """(tool, method, bad factor text) -> a call that must refuse it: the textual spellings
    (--methods, --position-scaling of the export and of training, --model-overrides) and the
    numeric ones (config fields, alibi_scaling and rope_parameters: HF configs, load keywords,
    set_alibi_scaling; keywords: apply_alibi_scaling), where the number means what it says."""
    from types import SimpleNamespace

    from fairseq_alibi.core.configuration_alibi import AlibiLMConfig, scaling_of_rope
    from fairseq_alibi.evaluation.axes import methods_for, parse_methods
    from fairseq_alibi.export import resolve_scaling
    from fairseq_alibi.models.config import check_override_keys

    def sweep(method, text):
        info = SimpleNamespace(name="model", extensions=("none", method), train_length=L, missing_length_hint="")
        return methods_for(info, parse_methods(f"none,{method}:{text}"))

    def export(method, text):
        source = SimpleNamespace(train_length=L, position=FACTOR_METHODS[method], path="model.pt", scaling=None)
        return resolve_scaling(f"{method}:{text}", source)

    def overrides(method, text):
        check_override_keys({"position_scaling": f"{method}:{text}"})
        return Scaling.from_config({"position_scaling": f"{method}:{text}", "alibi_train_length": L})

    def config_fields(method, text):
        return Scaling.from_config({"alibi_interpolation": method, "alibi_scale_factor": _number(text),
                                    "alibi_train_length": L})

    def hf_config(method, text):
        if FACTOR_METHODS[method] == "rotary" or method in ("linear", "ntk"):  # a rotary export's rope_parameters
            rope = {"rope_type": method, "factor": _number(text), "original_max_position_embeddings": L}
            scaling_of_rope(rope, L)
            return AlibiLMConfig(position_method="rotary", rope_parameters=rope, alibi_train_length=L)
        return AlibiLMConfig(position_method=FACTOR_METHODS[method], alibi_train_length=L,
                             alibi_scaling={"type": method, "factor": _number(text)})

    def keywords(method, text):
        return Scaling(method, _number(text), L)

    textual = {"alibi-sweep --methods": sweep, "alibi-export-hf --position-scaling": export,
               "--model-overrides / alibi-train --position-scaling": overrides}
    numeric = {"config fields": config_fields, "alibi_scaling / rope_parameters": hf_config,
               "keywords (apply_alibi_scaling, Scaling)": keywords}
    for method in FACTOR_METHODS:
        for name, text in BAD_FACTORS.items():
            for tool, call in textual.items():
                yield tool, method, name, text, call
            if name != "zero":  # a number 0 is dynamic (scale methods) or one training length (the others)
                for tool, call in numeric.items():
                    yield tool, method, name, text, call


@pytest.mark.parametrize("tool,method,name,text,call", list(_factor_entry_points()),
                         ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.fast_cases(12)
def test_every_tool_refuses_every_bad_factor_in_one_line(tool, method, name, text, call):
    """No tool scores a bad factor as another method: each refuses it as a user error of one line
    that names what was given (``yarn:`` ran dynamic YaRN, ``logn:`` logn x1, ``logn:1e308`` the
    unscaled model; the export raised an OverflowError)."""
    from fairseq_alibi.core.errors import UserError

    with pytest.raises(UserError) as refused:
        call(method, text)
    message = str(refused.value)
    assert "\n" not in message and "is not valid" in message, message
    shown = {"": "''", "1e308": "1e+308"}.get(text, text)
    given = (shown, f"{method}:{text}", f"factor': {_number(text)!r}", f"factor={_number(text)!r}") + (("int32",) if name == "times L overflows" else ())
    assert any(spelled in message for spelled in given), message
