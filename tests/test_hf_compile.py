"""Scaled Hugging Face models under ``torch.compile(fullgraph=True)`` and built
on the meta device, the way transformers' own tests and loaders use them.

* transformers' compiled generation (what its ``test_generate_compile_model_forward_fullgraph``
  runs): a static cache, ``CompileConfig(fullgraph=True, dynamic=False)``, two
  generations with no recompilation, equal to eager generation; BLOOM is the
  ALiBi family whose static cache works upstream (MPT has none, Falcon with
  ALiBi fails on one without our hooks too);
* ``model.forward = torch.compile(model.forward, fullgraph=True)`` with
  ``generate()``'s growing cache, for MPT, Falcon and an exported model;
* a model built under ``torch.device("meta")`` (as ``from_pretrained`` and
  ``init_empty_weights`` build them), scaled inside or after, ``to_empty`` and
  ``load_state_dict``: the same logits; no tensor that is neither parameter nor
  buffer; ``save_pretrained`` writes what an unscaled model writes.

Compiling takes seconds per model, so the models have one layer.  What these
tests check is dynamo's capture (one graph, its guards, no recompilation) and
the numbers of the captured graph, so they compile with the ``aot_eager``
backend (dynamo and AOTAutograd, no code generation); inductor's C++ code
generation costs 20-60 s a graph on a 2-core CPU and is torch's to test.  One
case, BLOOM's static-cache generation without scaling, compiles with inductor,
the backend users get.
"""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
from transformers import CompileConfig

from test_hf import logits, make_model, max_diff, tokens

from fairseq_alibi import hf
from fairseq_alibi.core.scaling import Scaling
from fairseq_alibi.core.configuration_alibi import AlibiLMConfig
from fairseq_alibi.hf.scaling import ScalingState
from fairseq_alibi.core.modeling_alibi import AlibiForCausalLM

TRAIN = 8  # training length: 12-token prompts and 5 new tokens run past it
METHODS = {"ntk static": dict(method="ntk", factor=2.0), "ntk dynamic": dict(method="ntk", factor=0.0),
           "cap": dict(method="cap", factor=1.0)}
#: The backend of every compile but one (see the docstring).
BACKEND = "aot_eager"
GENERATE = dict(do_sample=False, max_new_tokens=5, min_new_tokens=5, output_logits=True, return_dict_in_generate=True)


def recompilations(run) -> str:
    """What dynamo's guard log says about recompiling while ``run()`` runs."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    guards = logging.getLogger("torch._dynamo.guards")
    torch._logging.set_logs(recompiles_verbose=True)
    guards.addHandler(handler)
    try:
        run()
    finally:
        guards.removeHandler(handler)
        torch._logging.set_logs()
    return "\n".join(line for line in stream.getvalue().splitlines() if "Recompiling" in line)


def same_generation(eager, compiled) -> None:
    assert eager.sequences.tolist() == compiled.sequences.tolist()
    assert max(max_diff(a, b) for a, b in zip(eager.logits, compiled.logits)) < 1e-4


@pytest.mark.parametrize("method", ["none", *METHODS])
@pytest.mark.slow
def test_bloom_compiled_static_cache_generation_equals_eager_without_recompiling(method):
    torch.compiler.reset()
    model = make_model("bloom", layers=1)
    plain = [logits(model, tokens(12, batch=2, seed=s)) for s in (1, 2)]
    hf.apply_alibi_scaling(model, train_length=TRAIN, **METHODS.get(method, dict(method="none")))
    prompts = [tokens(12, batch=2, seed=s) for s in (1, 2)]
    if method != "none":  # the scaling acts on these prompts
        assert all(max_diff(logits(model, p), before) > 1e-3 for p, before in zip(prompts, plain))
    # attention masks with holes, as transformers' testers make them (the last column attended)
    masks = [(torch.rand(2, 12, generator=torch.Generator().manual_seed(s)) > 0.3).long() for s in (3, 4)]
    for mask in masks:
        mask[:, -1] = 1
    config = CompileConfig(fullgraph=True, dynamic=False, backend="inductor" if method == "none" else BACKEND)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless asked
    settings = dict(GENERATE, cache_implementation="static", compile_config=config)
    with torch.compiler.set_stance("force_eager"):
        eager = [model.generate(p, attention_mask=m, **settings) for p, m in zip(prompts, masks)]
    compiled = []
    log = recompilations(lambda: compiled.extend(model.generate(p, attention_mask=m, **settings)
                                                 for p, m in zip(prompts, masks)))
    assert log == ""
    assert hasattr(model, "_compiled_call")  # generate did compile the forward
    for a, b in zip(eager, compiled):
        same_generation(a, b)


def exported_model(scaling) -> AlibiForCausalLM:
    torch.manual_seed(0)
    config = AlibiLMConfig(vocab_size=60, hidden_size=32, layers=1, attention_heads=4, ffn_dim=64,
                           alibi_train_length=TRAIN, alibi_scaling=scaling, pad_token_id=0)
    model = AlibiForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.5)
    return model


@pytest.mark.parametrize("family,method,padded", [
    ("mpt", "ntk dynamic", False),
    ("falcon", "cap", False),
    ("exported", "ntk dynamic", False),
    ("exported", "ntk static", True),
])
@pytest.mark.slow
def test_fullgraph_compiled_forward_generates_what_eager_does(family, method, padded):
    torch.compiler.reset()
    spec = METHODS[method]
    if family == "exported":
        model = exported_model(Scaling(spec["method"], spec["factor"], TRAIN).to_hf())
    else:
        model = make_model(family, layers=1)
        hf.apply_alibi_scaling(model, train_length=TRAIN, **spec)
    prompt = tokens(12, batch=2)
    mask = torch.ones_like(prompt)
    if padded:
        mask[1, :3] = 0
    eager = model.generate(prompt, attention_mask=mask, **GENERATE)
    model.forward = torch.compile(model.forward, fullgraph=True, backend=BACKEND)
    same_generation(eager, model.generate(prompt, attention_mask=mask, **GENERATE))


@pytest.mark.slow
def test_exported_model_with_dynamic_scaling_and_padding_under_compile():
    """Rows grouped by length (a factor per row) cannot be one graph: fullgraph
    says why in our words; without fullgraph dynamo runs that part eagerly."""
    torch.compiler.reset()
    model = exported_model({"type": "ntk", "train_seq_len": TRAIN})
    prompt = tokens(12, batch=2)
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    expected = model(input_ids=prompt, attention_mask=mask).logits
    with pytest.raises(Exception, match="dynamic scaling or a non-Toeplitz bias \\(capnorm\\) on a padded batch groups the rows"):
        torch.compile(model.forward, fullgraph=True, backend=BACKEND)(input_ids=prompt, attention_mask=mask)
    got = torch.compile(model.forward, backend=BACKEND)(input_ids=prompt, attention_mask=mask).logits
    assert max_diff(got, expected) < 1e-5


def stray_tensors(model) -> list:
    """Tensors a model holds that are neither parameters nor buffers (what
    ``to_empty`` and ``.to()`` leave behind), the scaling hooks' state included."""
    found = []
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            fields = vars(value).items() if isinstance(value, ScalingState) else [(attr, value)]
            found += [f"{name}.{attr}.{field}" for field, item in fields if isinstance(item, torch.Tensor)]
    return found


@pytest.mark.parametrize("family", ["bloom", "mpt", "falcon", "exported"])
def test_meta_device_construction_to_empty_and_loading(family):
    if family == "exported":
        reference = exported_model({"type": "ntk", "train_seq_len": TRAIN})
    else:
        reference = make_model(family, layers=1)
        hf.apply_alibi_scaling(reference, "ntk", 0, train_length=TRAIN)
    assert stray_tensors(reference) == []
    ids = tokens(20)
    expected = logits(reference, ids)
    for scaled_where in ("inside", "after"):
        with torch.device("meta"):
            model = type(reference)(copy.deepcopy(reference.config))
            if scaled_where == "inside" and family != "exported":
                hf.apply_alibi_scaling(model, "ntk", 0, train_length=TRAIN)
        model.to_empty(device="cpu")
        if scaled_where == "after" and family != "exported":
            hf.apply_alibi_scaling(model, "ntk", 0, train_length=TRAIN)
        model.load_state_dict(reference.state_dict())
        assert stray_tensors(model) == []
        assert max_diff(logits(model.eval(), ids), expected) < 1e-5, scaled_where


@pytest.mark.parametrize("family", ["bloom", "mpt", "falcon"])
def test_scaling_adds_nothing_to_what_is_saved(family, tmp_path):
    model = make_model(family, layers=1)
    keys = set(model.state_dict())
    hf.apply_alibi_scaling(model, "cap", 1.0, train_length=TRAIN)
    assert set(model.state_dict()) == keys
    ids = tokens(20)
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)  # built on the meta device, then loaded
    hf.apply_alibi_scaling(loaded, "cap", 1.0, train_length=TRAIN)
    assert max_diff(logits(loaded.eval(), ids), expected) < 1e-5
