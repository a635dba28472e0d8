"""Every load keyword of every export format: it takes effect as the same setting does
in fairseq, or it is refused in one line (issue 77).

``from_pretrained(OUT, trust_remote_code=True, **keywords)`` sets the keywords on the
exported config after reading it; each one is either the context extension (the
position method's own key, ``alibi_scaling`` or ``rope_parameters``, and transformers'
older ``rope_scaling``), a setting the model reads at every call (kernel, cache,
dropout), transformers' own (``dtype``, ``attn_implementation``, ...), or a field the
weights fix, which may only repeat its exported value; anything else, and a config.json
key no part of the model reads, is refused.  The stock formats (BLOOM, GPT-NeoX) load
as transformers' own classes: transformers answers their keywords
(``test_export_positions``: GPT-NeoX's ``rope_parameters`` against the sweep's cells).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fairseq_alibi.core.configuration_alibi import LOAD_SETTINGS, AlibiLMConfig, rope_parameters_of
from fairseq_alibi.core.positions import extensions
from fairseq_alibi.core.scaling import Scaling
from test_export_positions import CUSTOM, WORDS, L, build, export, fairseq_log_probs, save, tokens

#: The export formats loaded through this package's classes: each position method's
#: trained shape (a rotary model with its own base and rotated share, kept in rope_parameters).
FORMATS = {"alibi": ["--arch", "transformer_lm_alibi"], "alibi-ssmax": CUSTOM["alibi-ssmax"],
           "rotary": ["--arch", "transformer_lm_rotary", "--rotary-base", "500", "--rotary-fraction", "0.5"],
           "rnope": CUSTOM["rnope"], "fire": CUSTOM["fire"], "sinusoidal": CUSTOM["sinusoidal"]}
#: One spelling of each extension method (static, the factor past 1 so it acts at 3 L).
SPELLINGS = {"none": "none", "linear": "linear:2", "ntk": "ntk:2", "yarn": "yarn:2", "cap": "cap:0.5",
             "log": "log:0.5:0.5", "power": "power:0.5:2", "capnorm": "capnorm:0.5", "logn": "logn:2"}
#: transformers' own keywords, each taken by every format (read by transformers, or the same value).
TRANSFORMERS_KEYWORDS = {"dtype": torch.float32, "torch_dtype": torch.float32, "attn_implementation": "eager",
                         "output_attentions": False, "output_hidden_states": False, "return_dict": True}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    """format -> (fairseq model, export directory), built on first use."""
    root = tmp_path_factory.mktemp("load_keywords")
    (root / "dict.txt").write_text("".join(f"w{i} {1000 - i}\n" for i in range(WORDS)))
    cache = {}

    def get(name):
        if name not in cache:
            model, cfg = build(root, FORMATS[name])
            status, output = export(save(model, cfg, root / f"{name}.pt"), root / name, "--format", "custom")
            assert status == 0, output
            cache[name] = (model, root / name)
        return cache[name]

    return get


def load(out: Path, **keywords):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, **keywords).eval()


def log_probs(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float().log_softmax(-1)


def other_value(value):
    """A value of the same kind that differs from ``value``."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "x"
    return {"not": "exported"}


def scaling_keyword(name: str, scaling: Scaling) -> dict:
    """The keyword a user gives for ``scaling`` on an export of ``name``: a rotary model's
    rope_parameters without its base and rotated share (those stay the exported ones)."""
    if name != "rotary":
        return {"alibi_scaling": scaling.to_hf()}
    rope = rope_parameters_of(scaling, 0.0, 0.0)
    return {"rope_parameters": {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}}


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.fast_cases(1)
def test_every_load_keyword_takes_effect_as_in_fairseq_or_is_refused(name, made):
    model, out = made(name)
    ids = tokens(3 * L)
    saved = json.loads((out / "config.json").read_text())

    def refused(match: str, **keywords):
        with pytest.raises(Exception) as error:  # the export's own copy of errors.UserError
            load(out, **keywords)
        assert getattr(error.value, "user_error", False), (keywords, repr(error.value))
        assert "\n" not in str(error.value) and match in str(error.value), (keywords, str(error.value))

    # the context extension: every method of the position method, the fairseq numbers; the other key refused
    own, other = ("rope_parameters", "alibi_scaling") if name == "rotary" else ("alibi_scaling", "rope_parameters")
    for method in ("none",) if name == "sinusoidal" else extensions(name.split("-")[0]):  # fairseq's stock model: none
        scaling = Scaling.parse(SPELLINGS[method], L)
        expected = fairseq_log_probs(model, ids, scaling)
        assert torch.allclose(log_probs(load(out, **scaling_keyword(name, scaling)), ids), expected, atol=1e-4), method
    refused(f"its context extension is {own}", **{other: {"type": "linear", "factor": 2.0} if other == "alibi_scaling"
                                                 else {"rope_type": "yarn", "factor": 2.0}})
    refused("is not valid", **{own: {"rope_type": "bogus"} if own == "rope_parameters" else {"type": "bogus"}})
    if name == "rotary":  # transformers' older name is the same key; the base and share stay the exported ones
        yarn = Scaling("yarn", 2.0, L)
        assert torch.allclose(log_probs(load(out, rope_scaling=scaling_keyword(name, yarn)["rope_parameters"]), ids),
                              fairseq_log_probs(model, ids, yarn), atol=1e-4)
        refused("rope_theta=10000.0 cannot be given", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                        "rope_theta": 10000.0})
    else:
        refused("reads no rope_parameters", rope_scaling={"rope_type": "linear", "factor": 2.0})

    # every other field of the config: a setting read at each call, or fixed by the weights
    fields = [f for f in AlibiLMConfig.__dataclass_fields__ if f in AlibiLMConfig.__annotations__]
    assert "ssmax" in fields and "position_params" in fields and "alibi_scaling" in fields
    for field in fields:
        if field in LOAD_SETTINGS:
            continue
        exported = saved.get(field)
        if field in ("ssmax", "position_params", "hidden_size"):  # the exported value itself is taken
            load(out, **{field: exported})
        refused(f"{field}=", **{field: other_value(exported)})
    load(out, alibi_attention="sdpa", use_cache=False, dropout=0.0)

    # transformers' own keywords; a keyword nothing reads
    assert torch.equal(log_probs(load(out, **TRANSFORMERS_KEYWORDS), ids), log_probs(load(out), ids))
    for keyword in ("rope_theta", "max_position_embeddings", "alibi_scale_factor", "position_scaling"):
        refused(f"{keyword}: not a setting of this exported model", **{keyword: 2})


def test_a_config_json_key_nothing_reads_is_refused(made, tmp_path):
    """A hand-edited config.json: a key the model does not read (transformers kept it as an
    attribute), a position parameter of another method, a rope_parameters beside alibi_scaling."""
    from transformers import AutoConfig

    _, out = made("fire")
    for key, value, match in (("rope_theta", 500.0, "rope_theta: not a setting"),
                              ("max_position_embeddings", 64, "max_position_embeddings: not a setting"),
                              ("position_params", {"fire_hidden": 8, "fire_threshold": 0.0, "t5_buckets": 8},
                               "position_params t5_buckets: this fire model does not read it"),
                              ("rope_parameters", {"rope_type": "linear", "factor": 2.0}, "reads no rope_parameters")):
        copy = tmp_path / key
        shutil.copytree(out, copy)
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps(dict(config, **{key: value})))
        with pytest.raises(Exception, match=match) as error:
            AutoConfig.from_pretrained(str(copy), trust_remote_code=True)
        assert getattr(error.value, "user_error", False), repr(error.value)
    AutoConfig.from_pretrained(str(out), trust_remote_code=True)  # auto_map, model_type, dtype: transformers' own
