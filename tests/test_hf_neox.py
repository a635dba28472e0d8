"""GPT-NeoX (rotary) under ``hf.apply_alibi_scaling`` and ``alibi-sweep --hf``: the scaled model is
transformers' own RoPE scaling.

The oracle is transformers itself: a GPT-NeoX *built* with the method's
``rope_parameters`` in its config (transformers computes the frequencies, its
dynamic update, YaRN's ramp and attention factor), holding the same weights.
Static NTK, which transformers has no type for, is checked against its
definition (RoPE with base ``theta x F ** (r / (r - 2))``, REFERENCE.md).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from fairseq_alibi import hf
from fairseq_alibi.core.scaling import Scaling

VOCAB, TRAIN_LENGTH, HEAD_DIM, ROTARY_PCT = 60, 16, 8, 0.5
ROTARY_DIM = int(HEAD_DIM * ROTARY_PCT)


def neox_config(**rope) -> GPTNeoXConfig:
    config = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=4 * HEAD_DIM, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=TRAIN_LENGTH, rotary_pct=ROTARY_PCT,
                           rotary_emb_base=500.0, use_parallel_residual=False, hidden_act="relu")
    if rope:
        config.rope_parameters = dict(config.rope_parameters, **rope)
    return config


def built(state=None, **rope) -> GPTNeoXForCausalLM:
    """A GPT-NeoX transformers builds from ``rope_parameters``; random weights, or ``state``."""
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(neox_config(**rope)).eval()
    if state is None:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.normal_(0, 0.3)
    else:
        model.load_state_dict(state)
    return model


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


IDS = torch.randint(0, VOCAB, (2, 3 * TRAIN_LENGTH), generator=torch.Generator().manual_seed(1))
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": TRAIN_LENGTH,
        "beta_fast": 32.0, "beta_slow": 1.0}


@pytest.mark.parametrize("scaling,rope", [
    (Scaling("linear", 2.0), {"rope_type": "linear", "factor": 2.0}),
    (Scaling("linear", 4.0), {"rope_type": "linear", "factor": 4.0}),
    (Scaling("yarn", 2.0, TRAIN_LENGTH), YARN),
    (Scaling("ntk", 0.0, TRAIN_LENGTH), {"rope_type": "dynamic", "factor": 1.0}),
    (Scaling("ntk", 2.0), {"rope_theta": 500.0 * 2.0 ** (ROTARY_DIM / (ROTARY_DIM - 2))}),
])
def test_scaled_neox_is_transformers_own_rope_scaling(scaling, rope):
    model = built()
    plain = logits(model, IDS)
    reference = built(model.state_dict(), **rope)
    hf.apply_alibi_scaling(model, scaling)
    scaled = logits(model, IDS)
    assert torch.allclose(scaled, logits(reference, IDS), atol=1e-6, rtol=0)
    assert not torch.allclose(scaled, plain, atol=1e-3)  # the method changed something
    settings = hf.alibi_scaling_settings(model)
    assert (settings["method"], settings["factor"]) == (scaling.method, scaling.factor)
    hf.remove_alibi_scaling(model)
    assert torch.equal(logits(model, IDS), plain) and model.config.rope_parameters["rope_type"] == "default"
    assert hf.alibi_scaling_settings(model) is None


def test_neox_scaling_within_the_training_length_changes_nothing_for_dynamic_ntk():
    model = built()
    plain = logits(model, IDS[:, :TRAIN_LENGTH])
    with hf.alibi_scaling(model, "ntk", 0.0):
        assert torch.allclose(logits(model, IDS[:, :TRAIN_LENGTH]), plain, atol=1e-6, rtol=0)
    assert torch.equal(logits(model, IDS[:, :TRAIN_LENGTH]), plain)


@pytest.mark.parametrize("kwargs,message", [
    (dict(method="linear", factor=0.0), "dynamic linear has no transformers rope_type; GPT-NeoX takes none, "
                                        "linear \\(static\\), ntk"),
    (dict(method="yarn", factor=0.0), "dynamic yarn has no transformers rope_type"),
    (dict(method="cap", factor=2.0), "cap does not apply to rotary models; the methods that do: none, linear, ntk, "
                                     "yarn"),
    (dict(method="linear", factor=2.0, bias_form="upstream"), "bias_form='upstream' applies to BLOOM and Falcon"),
    (dict(method="logn", factor=1.0), "logn has no transformers rope_type"),
])
def test_what_neox_cannot_compute_is_refused_in_one_line(kwargs, message):
    model = built()
    with pytest.raises(ValueError, match=message) as error:
        hf.apply_alibi_scaling(model, **kwargs)
    assert "\n" not in str(error.value) and hf.alibi_scaling_settings(model) is None
    with pytest.raises(ValueError, match="already extended"):
        hf.apply_alibi_scaling(built(**YARN), "linear", 2.0)


def test_families_read_a_neox_config():
    config = neox_config()
    assert hf.config_family(config) == hf.NEOX and hf.position_method(config) == "rotary"
    assert hf.hf_train_length(config) == TRAIN_LENGTH


@pytest.mark.slow
def test_alibi_sweep_hf_on_a_neox_directory_scores_transformers_own_scaling(tmp_path, monkeypatch):
    from test_hf import build_tokenizer, SENTENCES

    from fairseq_alibi.evaluation import perplexity

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = built()
    model.save_pretrained(tmp_path / "neox")
    build_tokenizer().save_pretrained(tmp_path / "neox")
    rng = random.Random(2)
    (tmp_path / "text.txt").write_text(" ".join(rng.choice(" ".join(SENTENCES).split()) for _ in range(100)) + "\n")
    argv = [str(tmp_path / "text.txt"), "--hf", f"neox={tmp_path / 'neox'}", "--lengths", "2x",
            "--methods", "none,linear:2,yarn:2", "--output-dir", str(tmp_path / "out"), "--cpu", "--no-progress"]
    assert perplexity.main(argv) == 0
    cells = {c["label"]: c for c in json.loads((tmp_path / "out" / "results.json").read_text())["cells"]}
    assert set(cells) == {"none", "linear x2", "yarn x2"}
    _, tokenizer = hf.load_hf_model(str(tmp_path / "neox"))
    ids = torch.tensor(tokenizer((tmp_path / "text.txt").read_text(), add_special_tokens=False)["input_ids"])
    length = 2 * TRAIN_LENGTH
    for label, rope in (("none", {}), ("linear x2", {"rope_type": "linear", "factor": 2.0}), ("yarn x2", YARN)):
        reference, total = built(model.state_dict(), **rope), 0.0
        for start in range(0, ids.numel() - 1, length):  # nonoverlapping windows of `length` inputs
            inputs, targets = ids[start:start + length], ids[start + 1:start + length + 1]
            logprobs = logits(reference, inputs[None])[0, :targets.numel()].double().log_softmax(-1)
            total -= float(logprobs.gather(-1, targets[:, None]).sum())
        assert cells[label]["tokens"] == ids.numel() - 1
        assert cells[label]["loss"] == pytest.approx(total / (ids.numel() - 1) / torch.log(torch.tensor(2.0)).item(),
                                                     abs=1e-5), label


@pytest.mark.parametrize("method,spelling", [("rotary", "yarn:2"), ("rotary", "linear"), ("kerple", "logn"),
                                             ("fire", "logn")])
def test_an_exported_model_takes_its_own_position_methods_extensions(method, spelling):
    """An export of any position method is scaled under that method's extension methods (RoPE's
    yarn for rotary, logn for every family), as if loaded with them in its config; a method
    of another family is refused, naming the model's own."""
    from fairseq_alibi.core.configuration_alibi import AlibiLMConfig, rope_parameters_of
    from fairseq_alibi.core.modeling_alibi import AlibiForCausalLM

    scaling = Scaling.parse(spelling, TRAIN_LENGTH).complete()

    def export(scaled: bool):
        extra = {}
        if method == "rotary":
            extra["rope_parameters"] = rope_parameters_of(scaling if scaled else Scaling(), 500.0, 0.5)
        config = AlibiLMConfig(vocab_size=VOCAB, hidden_size=32, layers=2, attention_heads=4, ffn_dim=64,
                               alibi_train_length=TRAIN_LENGTH, pad_token_id=0, position_method=method, **extra)
        return AlibiForCausalLM(config).eval()

    model, configured = export(False), export(True)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.3, generator=torch.Generator().manual_seed(parameter.numel()))
    configured.load_state_dict(model.state_dict())
    ids = IDS % (VOCAB - 1) + 1  # no pad id (0)
    if method != "rotary":
        configured.model.set_alibi_scaling(scaling)
    plain = logits(model, ids)
    hf.apply_alibi_scaling(model, scaling)
    assert torch.equal(logits(model, ids), logits(configured, ids))
    assert not torch.allclose(logits(model, ids), plain, atol=1e-4)
    hf.remove_alibi_scaling(model)
    assert torch.equal(logits(model, ids), plain)
    with pytest.raises(ValueError, match=f"cap does not apply to {method} models; the methods that do: none"):
        hf.apply_alibi_scaling(model, "cap", 2.0)


def test_what_transformers_has_no_rope_type_for_is_none_and_the_gpt_neox_export_refuses_it():
    """logn (and ALiBi's methods) never become another rope_type: None, and named by the export's check."""
    from fairseq_alibi.core.configuration_alibi import neox_rope_parameters
    from fairseq_alibi.export.neox import neox_shape_problems

    for spelling in ("logn", "logn:2", "cap", "capnorm"):
        assert neox_rope_parameters(Scaling.parse(spelling, TRAIN_LENGTH), 10000.0, 4, 8) is None, spelling
    fields = {"normalize_before": True, "layernorm_embedding": False, "final_layer_norm": True,
              "activation_function": "relu", "hidden_size": 32, "attention_heads": 4, "project_in": False,
              "project_out": False, "embed_quant_noise": False, "adaptive_input": None, "adaptive_softmax": None,
              "scale_attn": False, "scale_fc": False, "scale_heads": False, "scale_resids": False, "unk_aliases": 0,
              "ssmax": False}
    assert neox_shape_problems(fields, "rotary", 4, Scaling.parse("yarn:2", TRAIN_LENGTH)) == []
    problems = neox_shape_problems(fields, "rotary", 4, Scaling.parse("logn", TRAIN_LENGTH))
    assert any("logn scaling (transformers has no rope_type for it)" in p for p in problems), problems
    assert neox_rope_parameters(Scaling("yarn", 2.0, TRAIN_LENGTH), 10000.0, 4, 8)["rope_type"] == "yarn"
