"""One meaning of a padded batch on every path: a row scored in a batch equals
the row scored alone (docs/evaluating.md, "Padded batches").

Dynamic scaling takes each row's factor from its own keys (``max(1, n / L)``,
padding not counted) and ``capnorm`` counts keys from a row's first real token,
on the core kernels (what fairseq's layers run), the exported Hugging Face
model and the hooks on BLOOM, Falcon and MPT, with left and right padding.
"""

import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM, FalconConfig, FalconForCausalLM, MptConfig, MptForCausalLM

from fairseq_alibi import hf
from fairseq_alibi.core import kernels
from fairseq_alibi.core.bias import AlibiBias
from fairseq_alibi.core.configuration_alibi import AlibiLMConfig
from fairseq_alibi.core.errors import InputError
from fairseq_alibi.core.modeling_alibi import AlibiForCausalLM
from fairseq_alibi.core.scaling import Scaling

TRAIN = 6  # training length: rows of 5 to 16 tokens span dynamic factors 1 to 2.7
LENGTH = 16
#: (lead, real): a row of ``real`` tokens after ``lead`` padded ones, the rest padded on the right.
ROWS = [(0, 16), (0, 9), (5, 11), (3, 5)]
METHODS = ["ntk", "linear", "capnorm:0.5", "cap:0.5"]


def padding(rows=ROWS, length=LENGTH) -> torch.Tensor:
    """``[B, T]`` True at padded positions."""
    pad = torch.ones(len(rows), length, dtype=torch.bool)
    for row, (lead, real) in enumerate(rows):
        pad[row, lead:lead + real] = False
    return pad


def scaling(spelling: str) -> Scaling:
    return Scaling.parse(spelling, TRAIN)


# ------------------------------------------------------------------ the core kernels (fairseq's layers run these)
@pytest.mark.parametrize("spelling", METHODS + ["logn:0.5"])
@pytest.mark.parametrize("kernel", ["reference", "sdpa", "chunked"])
@pytest.mark.parametrize("mode", ["causal", "symmetric", "split"])
def test_core_kernels_score_each_row_as_alone(spelling, kernel, mode):
    """Left and right padding, in a decoder and in an encoder's both-ways modes
    (an encoder's capnorm counted the right padding as keys past C)."""
    torch.manual_seed(0)
    heads, dim = 4, 8
    q, k, v = (torch.randn(len(ROWS), heads, LENGTH, dim) * 2 for _ in range(3))
    bias = AlibiBias(heads, mode, scaling(spelling))
    with torch.no_grad():
        batch, _ = kernels.attend(q, k, v, bias, kernel, padding(), 0.0)
        for row, (lead, real) in enumerate(ROWS):
            span = slice(lead, lead + real)
            alone, _ = kernels.attend(q[row:row + 1, :, span], k[row:row + 1, :, span], v[row:row + 1, :, span],
                                      bias, kernel)
            torch.testing.assert_close(batch[row, :, span], alone[0], rtol=1e-5, atol=1e-5)


def test_core_groups_only_what_needs_it():
    pad = padding()
    assert kernels.row_groups(AlibiBias(4, "causal", scaling("ntk:2")), pad, LENGTH, LENGTH) is None
    assert kernels.row_groups(AlibiBias(4, "causal", scaling("cap")), pad, LENGTH, LENGTH) is None
    groups = kernels.row_groups(AlibiBias(4, "causal", scaling("ntk")), pad, LENGTH, LENGTH)
    factors = {bias.scaling.factor for _, _, bias in groups}
    assert factors == {max(1.0, real / TRAIN) for _, real in ROWS}
    cuts = kernels.row_groups(AlibiBias(4, "causal", scaling("capnorm")), pad, LENGTH, LENGTH)
    assert sorted(cut for _, (cut, _), _ in cuts) == sorted({lead for lead, _ in ROWS})
    assert {end for _, (_, end), _ in cuts} == {LENGTH}  # a decoder's trailing padding is masked, not cut
    both_ways = kernels.row_groups(AlibiBias(4, "symmetric", scaling("capnorm")), pad, LENGTH, LENGTH)
    assert sorted(span for _, span, _ in both_ways) == sorted((lead, lead + real) for lead, real in ROWS)


def test_a_dynamic_row_has_the_factor_of_its_own_keys_with_a_kv_cache():
    """Incremental steps: cached and new keys count, padding does not."""
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 4, 12, 8), torch.randn(2, 4, 12, 8)
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[1, :4] = True  # row 1: 8 real keys
    bias = AlibiBias(4, "causal", scaling("linear"))
    with torch.no_grad():
        batch, _ = kernels.attend(q, k, v, bias, "sdpa", pad, incremental=True)
        alone, _ = kernels.attend(q[1:], k[1:, :, 4:], v[1:, :, 4:], bias, "sdpa", incremental=True)
    torch.testing.assert_close(batch[1], alone[0], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ the exported model
def exported_model(alibi_scaling) -> AlibiForCausalLM:
    config = AlibiLMConfig(vocab_size=40, hidden_size=32, layers=2, attention_heads=4, ffn_dim=64,
                           alibi_train_length=TRAIN, alibi_scaling=alibi_scaling, normalize_before=True)
    model = AlibiForCausalLM(config)
    randomize(model)
    return model


def randomize(model, std: float = 0.5):
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    return model.eval()


def ids_and_mask(vocab: int = 40):
    ids = torch.randint(3, vocab, (len(ROWS), LENGTH), generator=torch.Generator().manual_seed(2))
    return ids, (~padding()).long()


def assert_rows_as_alone(model, **kwargs):
    ids, mask = ids_and_mask(model.config.vocab_size)
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask, use_cache=False, **kwargs).logits
        for row, (lead, real) in enumerate(ROWS):
            span = slice(lead, lead + real)
            alone = model(input_ids=ids[row:row + 1, span], use_cache=False, **kwargs).logits
            torch.testing.assert_close(batch[row, span], alone[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("value", [{"type": "ntk", "train_seq_len": TRAIN}, {"type": "linear", "train_seq_len": TRAIN},
                                   {"type": "capnorm", "factor": 0.5}], ids=["ntk", "linear", "capnorm"])
def test_exported_model_scores_each_row_as_alone(value):
    assert_rows_as_alone(exported_model(value))


def test_exported_model_reports_each_rows_factor():
    model = exported_model({"type": "linear", "train_seq_len": TRAIN})
    hf.apply_alibi_scaling(model, "linear", 0)
    ids, mask = ids_and_mask()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert hf.alibi_scaling_settings(model)["last_factor"] == pytest.approx([max(1.0, r / TRAIN) for _, r in ROWS])
    with torch.no_grad():
        model(input_ids=ids[:1], use_cache=False)
    assert hf.alibi_scaling_settings(model)["last_factor"] == pytest.approx(LENGTH / TRAIN)


# ------------------------------------------------------------------ the hooks on Hugging Face's ALiBi models
def hooked(family: str, spelling: str):
    heads, vocab = 4, 40
    if family == "bloom":
        model = BloomForCausalLM(BloomConfig(vocab_size=vocab, hidden_size=32, n_layer=2, n_head=heads))
    elif family == "falcon":
        model = FalconForCausalLM(FalconConfig(
            vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=heads, alibi=True,
            new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True,
            attn_implementation="sdpa"))
    else:
        model = MptForCausalLM(MptConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=heads, expansion_ratio=2,
                                         max_seq_len=64))
    randomize(model)
    return hf.apply_alibi_scaling(model, scaling(spelling))


@pytest.mark.parametrize("spelling", ["ntk", "linear", "capnorm:0.5"])
@pytest.mark.parametrize("family", ["bloom", "falcon"])
def test_hooks_score_each_row_as_alone(family, spelling):
    assert_rows_as_alone(hooked(family, spelling))


def test_mpt_refuses_rows_whose_numbers_would_differ_and_scores_rows_that_agree():
    """MPT adds one bias to every row: rows of different own lengths cannot share it."""
    model = hooked("mpt", "ntk")
    ids, mask = ids_and_mask()
    with pytest.raises(InputError, match="MPT adds one ALiBi bias to every row"), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    same = torch.ones(2, LENGTH, dtype=torch.long)
    same[0, 11:] = 0
    same[1, 11:] = 0  # two rows of 11 real tokens, right-padded: one factor
    with torch.no_grad():
        batch = model(input_ids=ids[:2], attention_mask=same, use_cache=False).logits
        alone = model(input_ids=ids[:1, :11], use_cache=False).logits
    torch.testing.assert_close(batch[0, :11], alone[0], rtol=1e-4, atol=1e-4)
